"""A multi-seed in-process sweep one run at a time against ``--jobs N`` runs side by side.

Runs ``online-sao simulate --driver inprocess`` twice on the same scenario, seeds and arms, into
two results directories: with ``--jobs 1`` and with ``--jobs N``. Reports each command's wall
time, their ratio, and whether every run's results agree (``results.decisions``: each reward, the
version that answered it and its sampled style; each learner step's rollout count, version and
metrics but its timings): the parallel sweep must write what the serial one writes.

    .venv/bin/python benchmarks/bench_parallel_sweep.py --scenario configs/drift.yaml --data-dir /tmp/pd \\
        --seeds 2 --arm sao --arm running_mean_w128 --jobs 2
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.experiments.aggregate import load_runs  # noqa: E402
from apps.experiments.results import decisions  # noqa: E402
from benchmarks.common import write_report  # noqa: E402


def sweep(args, jobs: int, out: Path) -> tuple[float, list[str]]:
    """Run the sweep with ``jobs``; (wall seconds, the command)."""
    command = [str(Path(sys.executable).parent / "online-sao"), "-c", args.scenario,
               "--set", f"paths.data_dir={args.data_dir}", "--set", f"experiment.results_dir={out}",
               "simulate", "--driver", "inprocess", "--seeds", str(args.seeds), "--jobs", str(jobs),
               *(f"--arm={a}" for a in args.arm)]
    print("$ " + shlex.join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start, command


def outcomes(out: Path, arms: list[str]) -> dict[tuple[int, str], tuple]:
    """Per (seed, arm): what the run decided (``results.decisions``: no clock readings)."""
    return {(run.scenario.seed, arm): decisions(run.arms[arm]) for run in load_runs(out) for arm in arms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--data-dir", required=True, help="where the default model is built (cached)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--arm", action="append", required=True)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_parallel_sweep"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/parallel_sweep.md"))
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    serial_s, serial_cmd = sweep(args, 1, args.work / "serial")
    parallel_s, parallel_cmd = sweep(args, args.jobs, args.work / "parallel")
    serial, parallel = outcomes(args.work / "serial", args.arm), outcomes(args.work / "parallel", args.arm)
    differing = sorted(key for key in serial if serial[key] != parallel.get(key))
    runs = len(serial)
    lines = [
        "# A multi-seed in-process sweep: one run at a time against runs side by side",
        "",
        f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='minutes')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs, no GPU; 1-min load average "
        f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at the end",
        f"- sweep: `{args.scenario}`, {args.seeds} seed(s) x {len(args.arm)} arm(s) ({', '.join(args.arm)}) "
        f"= {runs} runs, each with its seed's value pre-training pass where an arm has a critic",
        "",
        "| jobs | wall s | runs/min | command |",
        "|---:|---:|---:|---|",
        f"| 1 | {serial_s:.0f} | {runs / serial_s * 60:.2f} | `{shlex.join(serial_cmd[1:])}` |",
        f"| {args.jobs} | {parallel_s:.0f} | {runs / parallel_s * 60:.2f} | `{shlex.join(parallel_cmd[1:])}` |",
        "",
        f"**Speed-up with {args.jobs} jobs: {serial_s / parallel_s:.2f}x** (wall time of the whole command: "
        "model check, classifier, pre-training passes, the runs, the report).",
        "",
        (f"Results: all {runs} runs agree between the two sweeps (every reward, answering version and sampled "
         "style; every step's rollout count, version and metrics but its timings)." if not differing and runs else
         f"Results: {len(differing)} of {runs} runs DIFFER between the two sweeps: {differing}."),
        "",
    ]
    write_report(args.out, lines)
    return 0 if not differing and runs else 1


if __name__ == "__main__":
    sys.exit(main())
