"""The torch engine eager against compiled (ServingConfig.compile), one KV layout, one workload.

bench_kv_layout's closed loop: ``--concurrency`` clients each send their next request when the
last one ends, until ``--requests`` are answered, request ``i`` generating exactly its lognormal
draw of tokens after a corpus prompt. Each run is a fresh engine; runs alternate eager and
compiled (``--repeats`` pairs). The compiled engines share one model object, compiled in place by
the first of them, whose start (the warm-up that compiles) is timed on its own; a run's clock
starts after its engine has started. Reported per run: tokens/s, CPU seconds per request, the
engine's time in decode steps.

    .venv/bin/python benchmarks/bench_engine_compile.py --model-dir DIR [--kv-layout flat|padded] [--requests 96]
        [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_kv_layout import Run, header_lines, one_run, workload_parser, workload_plan  # noqa: E402
from benchmarks.common import write_report  # noqa: E402
from benchmarks.straggler.generator import chat_prompts  # noqa: E402
from online_sao.config import ServingConfig  # noqa: E402
from online_sao.modeling import load_policy, load_tokenizer  # noqa: E402
from serving.engine.torch_engine import TorchEngine  # noqa: E402

ARMS = ("eager", "compiled")


def warm_up_seconds(model, concurrency: int, kv_layout: str) -> float:
    """Seconds a compiling engine over ``model`` takes to start (its warm-up compiles ``model`` in place)."""
    engine = TorchEngine(model, cfg=ServingConfig(max_batch_size=concurrency, kv_layout=kv_layout, compile=True))

    async def start_and_stop() -> float:
        start = time.perf_counter()
        await engine.start()
        seconds = time.perf_counter() - start
        await engine.stop()
        return seconds

    return asyncio.run(start_and_stop())


def main(argv: list[str] | None = None) -> int:
    parser = workload_parser(__doc__.splitlines()[0], "engine_compile.md")
    parser.add_argument("--kv-layout", choices=["flat", "padded"], default="flat", help="the engines' KV layout")
    args = parser.parse_args(argv)
    layout = args.kv_layout
    torch.set_num_threads(args.threads)
    models = {"eager": load_policy(args.model_dir).eval()}
    models["compiled"] = copy.deepcopy(models["eager"])
    prompts = chat_prompts(load_tokenizer(args.model_dir))
    plan = workload_plan(args)
    load_before = os.getloadavg()[0]
    warm_up_s = warm_up_seconds(models["compiled"], args.concurrency, layout)
    one_run(models["eager"], prompts, plan[:args.concurrency], layout, args.concurrency)  # the eager arm's warm-up
    runs: list[tuple[str, Run]] = []
    for repeat in range(args.repeats):
        for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):
            run = one_run(models[arm], prompts, plan, layout, args.concurrency, compile=arm == "compiled")
            runs.append((arm, run))
            print(f"{arm}: {run.tokens_per_s:.0f} tokens/s ({run.wall_s:.2f} s)", flush=True)
    mean = {arm: statistics.mean(r.tokens_per_s for a, r in runs if a == arm) for arm in ARMS}
    pairs = [dict(pair)["compiled"].tokens_per_s / dict(pair)["eager"].tokens_per_s
             for pair in zip(runs[::2], runs[1::2])]
    lines = [
        *header_lines(f"The torch engine eager against compiled ({layout} KV layout)", args, argv, plan, load_before),
        f"- the first compiling engine's start (warm-up and compilation): {warm_up_s:.1f} s", "",
        "| run | engine | seconds | tokens/s | CPU s / request | decode s |",
        "|---:|---|---:|---:|---:|---:|",
        *[f"| {i + 1} | {arm} | {r.wall_s:.2f} | {r.tokens_per_s:.0f} | {r.cpu_s / args.requests:.4f} | "
          f"{r.decode_s:.2f} |" for i, (arm, r) in enumerate(runs)], "",
        f"**compiled / eager tokens/s: {mean['compiled'] / mean['eager']:.2f}x** (means over runs); per pair: "
        + ", ".join(f"{x:.2f}x" for x in pairs) + ".",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
