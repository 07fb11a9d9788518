"""The in-process driver against the live stack: per-phase levels of the same scenario and seeds.

Each argument names a results directory of ``online-sao simulate`` (one seed, or
``seed-<k>/`` directories); ``--live`` ones were run with ``--driver live``, ``--inprocess``
ones with ``--driver inprocess``. Runs are matched by ``experiment.seed``. Prints a
Markdown table: per arm and phase, the level (mean reward of the phase's last quarter)
of every seed under each driver, the means over seeds with their 95% bootstrap
intervals, and the difference of the means; and the post-switch mean alike.

    .venv/bin/python benchmarks/compare_drivers.py --live DIR [DIR ...] --inprocess DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.experiments.aggregate import Run, load_runs, seed_metrics  # noqa: E402
from apps.experiments.intervals import cell, interval  # noqa: E402


def runs_by_seed(directories: list[str], driver: str) -> dict[int, Run]:
    """The runs of ``directories`` by seed; each must have been run with ``driver`` (a live directory
    given as in-process, or the reverse, compared a driver with itself)."""
    runs = [run for d in directories for run in load_runs(Path(d))]
    wrong = sorted({str(run.directory) for run in runs if run.scenario.driver != driver})
    if wrong:
        raise SystemExit(f"not run with --driver {driver}: {', '.join(wrong)}")
    return {run.scenario.seed: run for run in runs}


def comparison(live: dict[int, Run], inprocess: dict[int, Run]) -> str:
    seeds = sorted(set(live) & set(inprocess))
    if not seeds:
        raise SystemExit(f"no seed in both: live {sorted(live)}, in-process {sorted(inprocess)}")
    scenario = live[seeds[0]].scenario
    arms = [a.name for a in scenario.arms if all(a.name in live[s].arms and a.name in inprocess[s].arms
                                                  for s in seeds)]
    if not arms:
        raise SystemExit(f"no arm finished under both drivers in every seed of {seeds}")
    head = ["arm", "measure", *(f"live s{s}" for s in seeds), *(f"in-process s{s}" for s in seeds),
            "live mean", "in-process mean", "in-process minus live"]
    lines = [f"Seeds {seeds}; level = mean reward of the phase's last quarter.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        per = {name: [seed_metrics(runs[s].arms[arm], runs[s].scenario) for s in seeds]
               for name, runs in (("live", live), ("inprocess", inprocess))}
        measures = [(f"level {p.style}", lambda m, k=k: m.phases[k].level) for k, p in enumerate(scenario.schedule)]
        measures.append(("post-switch mean", lambda m: m.post_switch_mean))
        for label, get in measures:
            a, b = [get(m) for m in per["live"]], [get(m) for m in per["inprocess"]]
            ia, ib = interval(a), interval(b)
            diff = f"{ib.mean - ia.mean:+.3f}" if ia and ib else "-"
            lines.append("| " + " | ".join([arm, label, *(f"{v:.3f}" for v in a), *(f"{v:.3f}" for v in b),
                                             cell(ia), cell(ib), diff]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", nargs="+", required=True)
    parser.add_argument("--inprocess", nargs="+", required=True)
    args = parser.parse_args(argv)
    print(comparison(runs_by_seed(args.live, "live"), runs_by_seed(args.inprocess, "inprocess")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
