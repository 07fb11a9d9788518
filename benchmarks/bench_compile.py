"""Learner model passes with compiled bodies against eager ones, same packed rollouts (``trainer.compile``).

The workload, model and timed work of bench_packing.py (the model passes of one SAO step on
packed rows: K critic updates' forward and backward, the critic's no-grad forward, the policy's
forward and backward), once with the bodies of policy and critic compiled in place
(:func:`online_sao.modeling.compile_body`) and once eagerly: the same modules, run eagerly
under ``torch.compiler.set_stance("force_eager")``. The two take turns on the same batches.
The compilation of the first batch of the compiled run is reported apart; any later recompilation
is not: the timed batches include it.

    .venv/bin/python benchmarks/bench_compile.py [--batches 24] [--out benchmarks/results/compile.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_packing import (add_batch_arguments, alternate, batches_line, learner_bench,  # noqa: E402
                                     model_passes, report_header, speed)
from benchmarks.common import write_report  # noqa: E402
from online_sao.config import AlgorithmConfig  # noqa: E402
from online_sao.modeling import compile_body  # noqa: E402


def timed(policy, critic, batch, cfg: AlgorithmConfig, compiled: bool) -> float:
    with nullcontext() if compiled else torch.compiler.set_stance("force_eager"):
        return model_passes(policy, critic, batch, cfg, packed=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser, rollouts=16, batches=24)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compile.md"))
    bench = learner_bench(parser, argv)
    args, cfg, base, load = bench.args, bench.cfg, bench.base, bench.load
    compile_body(bench.policy)
    compile_body(bench.critic)
    warm_up, times, batches = alternate(bench, lambda batch, compiled: timed(bench.policy, bench.critic, batch, cfg,
                                                                             compiled))
    compile_s = warm_up[True]
    measured = speed(times, batches)
    rate = measured.rate
    lowest = min(range(args.batches), key=measured.ratios.__getitem__)
    lines = [
        *report_header("Learner model passes: compiled bodies against eager ones (CPU)", "bench_compile.py", argv,
                       args.threads, load, base, f"critic with frozen attention, K = {cfg.critic_updates}, "
                       "rollouts packed"),
        batches_line(args, measured.real_tokens),
        f"- compilation: {compile_s:.1f} s for the first batch of the compiled run (inductor's on-disk cache, "
        "when it holds this graph, shortens it); the timed batches include any recompilation", "",
        "| bodies | real tokens/s | seconds per batch (median) |",
        "|---|---:|---:|",
        f"| eager | {rate[False]:.0f} | {statistics.median(times[False]):.3f} |",
        f"| compiled | {rate[True]:.0f} | {statistics.median(times[True]):.3f} |", "",
        measured.line("Compiled / eager real tokens per second") + f" (lowest: batch {lowest + 1}).", "",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
