"""Stragglers: a synchronous generate-then-train loop against SAO streaming (issue 6).

Response lengths are heavy-tailed: request ``i`` generates exactly
``min(cap, lognormal(log(median), sigma))`` tokens (seeded per request, the same
draws in both loops). Both loops use the same pieces: serving's TorchEngine
(continuous batching) over the same model in a generator process, the project's
SAO step (K critic updates, GAE, DIS policy update) in a learner process,
weights published to a FileWeightStore and hot-swapped by the engine, one torch
thread per process by default (see benchmarks/straggler/).

* sync: a batch of ``--groups-per-batch`` groups of ``--group-size`` requests
  (the same prompt G times) is generated; when ALL are done the learner trains on
  the batch and publishes; the engine switches to the new weights; repeat.
* stream: the engine keeps ``--concurrency`` requests in flight (a new one when
  one finishes) and switches to every new version between decode steps; the
  learner trains whenever trainer/feed.py's readiness rule says (min_rollouts or
  token_budget ready), never waiting for a group or a batch.

Measured per loop, over the same number of trained rollouts (``--rollouts``) or
the same wall time (``--duration-s``): rollouts and action tokens trained per
second, the mean length of the trained rollouts, the share of time the learner is
not in a step, the share of time the engine runs no prefill or decode step, and
the ratio streaming / sync of trained tokens/s (streaming trains rollouts in the
order they finish, so over a short loop its rollouts are the shorter ones and its
rollouts/s overstates it).

    .venv/bin/python benchmarks/bench_straggler.py [--sigma 1] [--rollouts 384] [--repeats 2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.straggler.report import write_plot, write_report  # noqa: E402
from benchmarks.straggler.runner import LoopResult, run_loops  # noqa: E402
from benchmarks.straggler.spec import LoopSpec, Mode  # noqa: E402
from apps.config import load_app_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ROLLOUTS = 384
"""Rollouts trained per loop when neither --rollouts nor --duration-s is given: 24 synchronous batches,
long enough that the rollouts still in flight when a streaming loop ends (at most --concurrency, the
long ones) change its trained lengths little (see the report's *mean length* column)."""
MAX_UNTRAINED_STEPS = 4
"""Streaming backpressure in learner steps of ``max_rollouts_per_step`` (trainer/feed.py's
READY_BACKLOG_STEPS): the generator holds new requests while that many rollouts wait."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    p.add_argument("--median-tokens", type=int, default=32, help="median response length")
    p.add_argument("--max-tokens", type=int, default=256, help="cap on a response's length")
    p.add_argument("--group-size", type=int, default=4, help="requests per prompt (G)")
    p.add_argument("--groups-per-batch", type=int, default=4, help="groups in one synchronous batch")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight when streaming (default: the synchronous batch size)")
    p.add_argument("--rollouts", type=int, default=None,
                   help=f"end a loop once this many rollouts are trained (default {DEFAULT_ROLLOUTS} "
                        "unless --duration-s is given)")
    p.add_argument("--duration-s", type=float, default=None, help="end a loop after this many seconds")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the generator and of the learner each")
    p.add_argument("--kv-layout", choices=["padded", "flat"], default=None,
                   help="the torch engine's cache layout in both loops (default: the config's serving.kv_layout)")
    p.add_argument("--compile", action="store_true",
                   help="compile the learner's bodies in both loops (trainer.compile; compiled before the first loop)")
    p.add_argument("--engine-compile", action="store_true",
                   help="compile the torch engine's body in both loops (serving.compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop, alternating which goes first")
    p.add_argument("--model-dir", default=None, help="model directory (default: the default model, built if absent)")
    p.add_argument("--out", type=Path, default=RESULTS / "straggler.md", help="report; the plot goes beside it (.png)")
    args = p.parse_args(argv)
    if args.rollouts is None and args.duration_s is None:
        args.rollouts = DEFAULT_ROLLOUTS
    return args


def default_model_dir() -> str:
    from apps.default_model.builder import build_base_model

    return str(build_base_model(load_app_config(environ={})))


def loop_specs(args: argparse.Namespace, model_dir: str, weights_root: Path) -> list[LoopSpec]:
    cfg = load_app_config(environ={})
    order: list[Mode] = []
    for repeat in range(args.repeats):
        order += ["sync", "stream"] if repeat % 2 == 0 else ["stream", "sync"]
    concurrency = args.concurrency or args.group_size * args.groups_per_batch
    return [LoopSpec(mode=mode, model_dir=model_dir, weights_dir=str(weights_root / f"loop{i}-{mode}"),
                     sigma=args.sigma, median_tokens=args.median_tokens, max_tokens=args.max_tokens,
                     group_size=args.group_size, groups_per_batch=args.groups_per_batch, concurrency=concurrency,
                     rollouts=args.rollouts, duration_s=args.duration_s, seed=args.seed,
                     max_untrained=MAX_UNTRAINED_STEPS * cfg.trainer.max_rollouts_per_step,
                     kv_layout=args.kv_layout or cfg.serving.kv_layout, engine_compile=args.engine_compile,
                     algorithm=cfg.algorithm, trainer=cfg.trainer.model_copy(update={"compile": args.compile}))
            for i, mode in enumerate(order)]


def run_benchmark(args: argparse.Namespace, progress=print) -> list[LoopResult]:
    model_dir = args.model_dir or default_model_dir()
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as tmp:
        return run_loops(loop_specs(args, model_dir, Path(tmp)), threads=args.threads, progress=progress)


def untrained_loops(results: list[LoopResult]) -> str | None:
    """Why the report cannot be written when a loop trained nothing (its rates would divide by zero):
    with ``--duration-s`` a synchronous loop ends before its first batch when the batch's longest
    answer takes longer to sample than the duration. None when every loop trained."""
    empty = [f"{i} ({r.spec.mode})" for i, r in enumerate(results) if r.trained == 0]
    if not empty:
        return None
    return (f"loop(s) {', '.join(empty)} trained no rollout in --duration-s {results[0].spec.duration_s} s: "
            "a synchronous loop trains only once its whole batch is answered; give a longer --duration-s")


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    results = run_benchmark(args)
    if (why := untrained_loops(results)) is not None:
        raise SystemExit(f"bench_straggler: {why}")
    plot = args.out.with_suffix(".png")
    write_plot(results, plot)
    write_report(args, argv if argv is not None else sys.argv[1:], results, plot, load_before, os.getloadavg()[0])
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
