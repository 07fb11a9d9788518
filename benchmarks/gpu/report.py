"""benchmarks/results/gpu.md from the sections benchmarks/gpu/check.sh ran.

Reads ``<work>/<section>.status`` (exit status and seconds), ``<section>.log``,
``<section>.json`` (the helpers' results) and, for the tests, ``gpu_tests.xml``
(JUnit) or the collection listing of a dry run. Exit status 1 when a section failed.

    python benchmarks/gpu/report.py --work DIR --out FILE --mode gpu|dry-run --command "..."
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SECTIONS = {"gpu_tests": "1. gpu-marked tests", "learner_step": "2. Learner step (SAO, FSDP2)",
            "engines": "3. Serving engines", "transports": "4. Weight transports"}
MFU_TARGET = 0.40
"""The issue's target for the learner step on an H200."""


def status_of(work: Path, name: str) -> tuple[int | None, int | None]:
    path = work / f"{name}.status"
    if not path.exists():
        return None, None
    code, seconds = path.read_text().split()
    return int(code), int(seconds)


def log_tail(work: Path, name: str, lines: int = 15) -> list[str]:
    path = work / f"{name}.log"
    text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
    return ["```", *text, "```"]


def tests_section(work: Path, mode: str) -> tuple[bool, list[str]]:
    code, _ = status_of(work, "gpu_tests")
    log = (work / "gpu_tests.log").read_text(errors="replace") if (work / "gpu_tests.log").exists() else ""
    note = work / "gpu_tests.note"  # check.sh says what it deselected and why
    noted = [f"Note: {note.read_text().strip()}.", ""] if note.exists() else []
    if mode == "dry-run":
        ids = [line for line in log.splitlines() if "::" in line]
        return code == 0 and bool(ids), [*noted, f"Dry run: collected, not run ({len(ids)} tests):", "",
                                         *[f"- `{i}`" for i in ids]]
    xml = work / "gpu_tests.xml"
    if not xml.exists():
        return False, ["No test results (JUnit file missing).", "", *log_tail(work, "gpu_tests")]
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    rows = []
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        rows.append(f"| `{case.get('classname')}::{case.get('name')}` | {outcome} | {float(case.get('time', 0)):.2f} |")
    failed = sum(r.split(" | ")[1] in ("failure", "error") for r in rows)
    return code == 0 and bool(cases), [*noted, f"{len(cases)} tests, {failed} failed or errored.", "",
                                       "| test | outcome | s |", "|---|---|---:|", *rows]


def learner_section(r: dict, mode: str) -> list[str]:
    mfu = "n/a (no GPU peak for this device)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    lines = [
        f"- model: default architecture (qwen2) at size `{r['size']}`, {r['parameters'] / 1e6:.1f} M parameters, "
        f"random weights, float32 parameters computing in {r['dtype']} (FSDP2 mixed precision, as the learner); "
        f"critic: a copy with frozen attention, K = {r['critic_updates']} updates",
        f"- FSDP2 (`fully_shard` per decoder layer and root) on {r['world_size']} rank(s), backend `{r['backend']}`",
        f"- batch per rank: {r['rollouts_per_rank']} rollouts x ({r['prompt_tokens']} prompt + {r['action_tokens']} "
        "action tokens), no padding", "",
        "| step s (median) | tokens/s | action tokens/s | FLOPs/step (counted) | achieved TFLOP/s | peak TFLOP/s | "
        "MFU | max GPU memory GiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['step_s_median']:.3f} | {r['tokens_per_s']:.0f} | {r['action_tokens_per_s']:.0f} | "
        f"{r['flops_per_step']:.3e} | {r['achieved_tflops']:.1f} | {r['peak_tflops'] or 'n/a'} | {mfu} | "
        f"{'n/a' if r['max_memory_gib'] is None else round(r['max_memory_gib'], 1)} |", "",
        f"Step times (s): {', '.join(f'{t:.3f}' for t in r['step_s'])}. FLOPs are counted by torch's "
        "FlopCounterMode over one step (matrix products and attention, forward and backward, attention run "
        "eagerly for the count: no flash-attention recompute); "
        "MFU divides them by the median step time and the dense bf16 peak (989.4 TFLOP/s for the H200).",
    ]
    if r["mfu"] is not None:
        verdict = "meets" if r["mfu"] >= MFU_TARGET else "is below"
        lines += ["", f"MFU {100 * r['mfu']:.1f}% {verdict} the {100 * MFU_TARGET:.0f}% target."]
    if "larger_batch" in r:
        lines += ["", larger_batch_line(r["larger_batch"])]
    if "profile" in r:
        lines += ["", *profile_lines("One more eager step under the profiler", r["profile"], "step")]
    if "phases" in r:
        lines += ["", *phase_lines(r["phases"])]
    lines += ["", *(compiled_lines(r["compiled"]) if "compiled" in r
                    else ["With the bodies compiled (`trainer.compile`): not run (`--no-compile`)."])]
    return lines


def phase_lines(split: dict) -> list[str]:
    """One eager step synchronised around each phase (learner_step.py ``phase_split``)."""
    total, phases = split["step_s"], split["phases_s"]
    rest = total - sum(phases.values())
    rows = [f"| {name} | {seconds:.4f} | {100 * seconds / total:.1f}% |"
            for name, seconds in sorted(phases.items(), key=lambda item: -item[1])]
    return [f"One more eager step, the device synchronised around each phase: {total:.3f} s in all.", "",
            "| phase | s | share of the step |", "|---|---:|---:|", *rows,
            f"| outside the timed phases | {rest:.4f} | {100 * rest / total:.1f}% |"]


def larger_batch_line(b: dict) -> str:
    """The eager steps on more rollouts (learner_step.py ``--larger-batch``)."""
    if "error" in b:
        return f"At {b['rollouts_per_rank']} rollouts per rank: no result, `{b['error']}`."
    mfu = "n/a" if b["mfu"] is None else f"{100 * b['mfu']:.1f}%"
    memory = "" if b["max_memory_gib"] is None else f", {b['max_memory_gib']:.1f} GiB at most"
    return (f"At {b['rollouts_per_rank']} rollouts per rank, eager: median step {b['step_s_median']:.3f} s, "
            f"{b['tokens_per_s']:.0f} tokens/s, {b['achieved_tflops']:.1f} TFLOP/s, MFU {mfu}{memory}.")


def compiled_lines(c: dict) -> list[str]:
    """The same steps with the bodies compiled (``trainer.compile``; learner_step.py ``--compile``)."""
    if "error" in c:
        return [f"With the bodies compiled (`trainer.compile`): no result, `{c['error']}`."]
    mfu = "n/a" if c["mfu"] is None else f"{100 * c['mfu']:.1f}%"
    lines = [f"With the bodies compiled (`trainer.compile`), after {c['compile_s']:.1f} s of compiling step: "
             f"median step {c['step_s_median']:.3f} s, {c['tokens_per_s']:.0f} tokens/s, "
             f"{c['achieved_tflops']:.1f} TFLOP/s, MFU {mfu} (steps: {', '.join(f'{t:.3f}' for t in c['step_s'])})."]
    if c["mfu"] is not None:
        verdict = "meets" if c["mfu"] >= MFU_TARGET else "is below"
        lines.append(f"Compiled, MFU {100 * c['mfu']:.1f}% {verdict} the {100 * MFU_TARGET:.0f}% target.")
    return lines


def profile_lines(title: str, prof: dict, unit: str) -> list[str]:
    """One profiled run (``common.profile_summary``): wall and GPU-busy time, host waits, top kernels."""
    if "error" in prof:
        return [f"{title}: the profiler failed, `{prof['error']}`."]
    busy = ("n/a (no GPU)" if prof["gpu_busy_ms_per_unit"] is None
            else f"{prof['gpu_busy_ms_per_unit']:.2f} ms ({100 * prof['gpu_busy_share']:.0f}% of the wall time)")
    waits = ", ".join(f"`{name}` {count:.1f}" for name, count in prof["waits_per_unit"].items()) or "none counted"
    lines = [f"{title}, per {unit}: wall {prof['wall_ms_per_unit']:.2f} ms, GPU busy {busy}; CUDA calls the host "
             f"may wait in, per {unit}: {waits}."]
    if not prof["top"]:  # on a CPU the profiler sees this thread only, and the engine works in its own
        return lines + ["", f"(No {prof['top_by']} seen: the work ran in another thread.)"]
    return lines + ["", f"| top by {prof['top_by']} | ms per {unit} | calls per {unit} |", "|---|---:|---:|",
                    *[f"| `{t['name'].replace('|', '/')}` | {t['ms_per_unit']:.3f} | {t['calls_per_unit']:.1f} |"
                      for t in prof["top"]]]


def engines_section(r: dict) -> list[str]:
    vllm = r["vllm"]
    concurrency = list(r["torch_engine_tokens_per_s"])
    lines = [f"- model: default architecture at size `{r['size']}`, {r['parameters'] / 1e6:.1f} M parameters, "
             f"{r['dtype']}; {r['new_tokens']} new tokens per request, temperature 1", "",
             "| engine | " + " | ".join(f"c={c} tokens/s" for c in concurrency) + " |",
             "|---|" + "---:|" * len(concurrency),
             "| TorchEngine | " + " | ".join(f"{r['torch_engine_tokens_per_s'][c]:.0f}" for c in concurrency) + " |"]
    if "torch_engine_flat_tokens_per_s" in r:
        lines.append("| TorchEngine, `kv_layout: flat` | "
                     + " | ".join(f"{r['torch_engine_flat_tokens_per_s'][c]:.0f}" for c in concurrency) + " |")
    if vllm["imported"]:
        lines.append(f"| vLLM {vllm['version']} | " + " | ".join(f"{vllm['tokens_per_s'][c]:.0f}"
                                                                   for c in concurrency) + " |")
    lines += ["", f"`model.generate`, one request at a time: {r['generate_tokens_per_s']:.0f} tokens/s "
              f"(TorchEngine at c={concurrency[0]}: {r['torch_engine_tokens_per_s'][concurrency[0]]:.0f})."]
    if not vllm["imported"]:
        lines += ["", f"vLLM did not import here: `{vllm['error']}`"]
    for name, title in (("generate", "`generate`, one request"), ("torch_engine", "TorchEngine, one request")):
        if name in r.get("profiles_c1", {}):
            lines += ["", *profile_lines(title, r["profiles_c1"][name], "token")]
    return lines


def transports_section(r: dict) -> list[str]:
    lines = [f"- state dict: default architecture at size `{r['size']}` ({r['tensors']} tensors, {r['mib']:.1f} MiB, "
             f"{r['dtype']}), saved by this process, loaded by a second one; median of {r['repeats']} after one "
             "warm-up", "", "| transport | save ms | load ms (other process) | loaded onto |", "|---|---:|---:|---|"]
    for name, m in r["medians"].items():
        t = r["times"][name]
        lines.append(f"| {name} | {m['save_ms']:.1f} (min {1e3 * min(t['save_s']):.1f}) | "
                     f"{m['load_ms']:.1f} (min {1e3 * min(t['load_s']):.1f}) | {', '.join(m['loaded_on'])} |")
    lines += [f"| {name} | not run: {why} | | |" for name, why in r["skipped"].items()]
    return lines


RENDER = {"learner_step": lambda r, mode: learner_section(r, mode), "engines": lambda r, mode: engines_section(r),
          "transports": lambda r, mode: transports_section(r)}


def helper_section(work: Path, name: str, mode: str) -> tuple[bool, list[str]]:
    code, _ = status_of(work, name)
    path = work / f"{name}.json"
    if not path.exists():
        why = "did not run" if code is None else ("ran out of time" if code in (124, 137) else f"exit status {code}")
        return False, [f"No result ({why}).", "", *log_tail(work, name)]
    result = json.loads(path.read_text())
    if not result["ok"]:
        return False, [f"Failed: `{result['error']}`", "", "```", result["traceback"], "```"]
    return code == 0, RENDER[name](result, mode)


def machine_line(work: Path) -> str:
    for name in ("learner_step", "engines", "transports"):
        path = work / f"{name}.json"
        if path.exists() and "machine" in (result := json.loads(path.read_text())):
            m = result["machine"]
            gpu = f"{m['gpu']} ({m['gpu_memory_gib']} GiB), CUDA {m['cuda']}" if "gpu" in m else "no GPU"
            return (f"{m['platform']}, {m['cpus']} CPUs, {gpu}; Python {m['python']}, torch {m['torch']}")
    return "unknown (no section reported it)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["gpu", "dry-run"], required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="the ones check.sh ran, comma-separated")
    args = parser.parse_args(argv)
    chosen = args.sections.split(",")
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    title = "GPU checks" + (" (DRY RUN on a CPU: tiny model, gloo; no GPU numbers)" if args.mode == "dry-run" else "")
    lines = [f"# {title}", "", f"- command: `{args.command}`", f"- machine: {machine_line(args.work)}",
             f"- written: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"]
    if args.mode == "dry-run":
        lines += ["- a dry run checks that every section starts and reports; its numbers say nothing about speed"]
    seconds, failed = [], []
    for name, heading in SECTIONS.items():
        if name not in chosen:
            lines += ["", f"## {heading}: not run in this call (`--sections`)"]
            continue
        ok, body = tests_section(args.work, args.mode) if name == "gpu_tests" else \
            helper_section(args.work, name, args.mode)
        code, took = status_of(args.work, name)
        seconds.append(took or 0)
        state = "ok" if ok else "FAILED"
        failed += [] if ok else [name]
        lines += ["", f"## {heading}: {state} ({took if took is not None else '-'} s)", "", *body]
    lines += ["", f"Sections: {len(chosen) - len(failed)} ok, {len(failed)} failed"
              f"{' (' + ', '.join(failed) + ')' if failed else ''}; {sum(seconds)} s in all "
              f"(longest {max(seconds)} s, median {statistics.median(seconds):.0f} s).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
