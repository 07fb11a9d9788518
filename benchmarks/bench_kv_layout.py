"""The torch engine's two KV layouts on the same closed-loop workload (ServingConfig.kv_layout).

``--concurrency`` clients each send their next request when the last one ends, until
``--requests`` are answered; request ``i`` generates exactly ``lognormal(log median, sigma)``
tokens (capped, no stop token: the straggler benchmark's draw of seed 0) after a corpus prompt in the
chat template. Each run is one layout on a fresh engine; runs alternate layouts (``--repeats``
pairs), so the two see the same machine. Reported per run: wall seconds, generated tokens per
second, process CPU seconds per request, and the engine's time in prefill and decode steps.

    .venv/bin/python benchmarks/bench_kv_layout.py [--model-dir DIR] [--requests 96] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import write_report  # noqa: E402
from benchmarks.straggler.generator import chat_prompts  # noqa: E402
from benchmarks.straggler.spec import lognormal_length  # noqa: E402
from online_sao.config import ServingConfig  # noqa: E402
from online_sao.modeling import load_policy, load_tokenizer  # noqa: E402
from online_sao.schemas import SamplingParams  # noqa: E402
from serving.engine.base import GenerationRequest  # noqa: E402
from serving.engine.torch_engine import StepStats, TorchEngine  # noqa: E402

LAYOUTS = ("padded", "flat")


@dataclass(frozen=True)
class Run:
    layout: str
    wall_s: float
    tokens: int
    cpu_s: float
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def one_run(model, prompts: list[list[int]], plan: list[int], layout: str, concurrency: int,
            compile: bool = False) -> Run:
    """One closed-loop run on a fresh engine over ``model`` (its start, and so a compiling engine's
    warm-up, is not timed)."""
    steps: list[StepStats] = []
    cfg = ServingConfig(max_batch_size=concurrency, kv_layout=layout, compile=compile)
    engine = TorchEngine(model, cfg=cfg, on_step=steps.append)
    produced = 0

    async def main() -> tuple[float, float]:
        await engine.start()
        queue = list(enumerate(plan))

        async def client() -> None:
            nonlocal produced
            while queue:
                i, n = queue.pop(0)
                request = GenerationRequest(f"r{i}", prompts[i % len(prompts)], SamplingParams(max_tokens=n, seed=i))
                async for _ in engine.generate(request):
                    produced += 1

        steps.clear()  # a compiling engine's warm-up steps
        cpu = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        await engine.stop()
        return wall, cpu

    wall, cpu = asyncio.run(main())
    return Run(layout, wall, produced, cpu, sum(s.seconds for s in steps if s.kind == "prefill"),
               sum(s.seconds for s in steps if s.kind == "decode"))


def workload_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The closed-loop workload's arguments (this benchmark's and bench_engine_compile's); ``out``:
    the default report under benchmarks/results/."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-dir", required=True, help="a Hugging Face model directory (e.g. the default model)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--median-tokens", type=int, default=32)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs, the first arm alternating")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / out)
    return p


def workload_plan(args: argparse.Namespace) -> list[int]:
    """Tokens each request generates: the straggler benchmark's draws of seed 0."""
    return [lognormal_length(0, i, args.median_tokens, args.sigma, args.max_tokens) for i in range(args.requests)]


def header_lines(title: str, args: argparse.Namespace, argv: list[str] | None, plan: list[int],
                 load_before: float) -> list[str]:
    """The report's title, command, date, machine, model and workload lines."""
    return [
        f"# {title}", "",
        f"- command: `{shlex.join(['python'] + [str(a) for a in (argv if argv is not None else sys.argv)])}`",
        f"- date: {time.strftime('%Y-%m-%dT%H:%M%z')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs, no GPU; 1-min load average "
        f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}, "
        f"{args.threads} thread(s)",
        f"- model: {args.model_dir}",
        f"- workload: {args.requests} requests, {args.concurrency} clients in a closed loop (engine max_batch_size "
        f"{args.concurrency}); corpus prompts in the chat template; lengths lognormal(log {args.median_tokens}, "
        f"{args.sigma}) capped at {args.max_tokens} ({sum(plan)} tokens, longest {max(plan)}), no stop token",
    ]


def main(argv: list[str] | None = None) -> int:
    args = workload_parser(__doc__.splitlines()[0], "kv_layout.md").parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_policy(args.model_dir).eval()
    prompts = chat_prompts(load_tokenizer(args.model_dir))
    plan = workload_plan(args)
    load_before = os.getloadavg()[0]
    one_run(model, prompts, plan[:args.concurrency], "padded", args.concurrency)  # warm-up
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for layout in (LAYOUTS if repeat % 2 == 0 else LAYOUTS[::-1]):
            runs.append(one_run(model, prompts, plan, layout, args.concurrency))
            r = runs[-1]
            print(f"{layout}: {r.tokens_per_s:.0f} tokens/s ({r.wall_s:.2f} s)", flush=True)
    mean = {layout: statistics.mean(r.tokens_per_s for r in runs if r.layout == layout) for layout in LAYOUTS}
    pairs = [b.tokens_per_s / a.tokens_per_s if a.layout == "padded" else a.tokens_per_s / b.tokens_per_s
             for a, b in zip(runs[::2], runs[1::2])]
    lines = [
        *header_lines("The torch engine's KV layouts: padded against flat", args, argv, plan, load_before), "",
        "| run | layout | seconds | tokens/s | CPU s / request | prefill s | decode s |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *[f"| {i + 1} | {r.layout} | {r.wall_s:.2f} | {r.tokens_per_s:.0f} | {r.cpu_s / args.requests:.4f} | "
          f"{r.prefill_s:.2f} | {r.decode_s:.2f} |" for i, r in enumerate(runs)], "",
        f"**flat / padded tokens/s: {mean['flat'] / mean['padded']:.2f}x** (means over runs); per pair: "
        + ", ".join(f"{x:.2f}x" for x in pairs) + ".", "",
        "*prefill s* / *decode s*: the engine's time in prefill and decode steps. In the flat layout a prompt "
        "that joins a running batch is prefilled inside a decode step, so only prompts admitted to an empty "
        "batch count as prefill.",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
