"""Whether the seeds of one results directory ran one scenario with one set of settings.

``simulate --seeds N`` writes seeds that do; a directory put together by hand from one-seed runs
(as several docs/drift-*/ READMEs do) need not. The report, ``benchmarks/drift_diagnostics.py`` and
``benchmarks/compare_drivers.py`` read every seed with the first seed's phases and headline, so a seed
of another schedule, drop rate or learning rate was averaged in as if it were one more draw of the same
experiment, without a word (:func:`differences`; :func:`apps.experiments.aggregate.load_runs` refuses
such a directory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from apps.experiments.resume import PER_RUN_FIELDS, setting_differences
from apps.experiments.results import scenario_fields
from online_sao.config import ConfigError

if TYPE_CHECKING:
    from apps.experiments.aggregate import Run

PER_SEED_SCENARIO_FIELDS = frozenset({"seed", "prompt_seed", "seeds"})
"""Scenario fields each seed has its own of (``orchestrate.seed_config``), or that count the seeds."""
PER_SEED_SETTINGS = frozenset({"trainer.seed"}) | PER_RUN_FIELDS
"""An arm's recorded settings (``ArmSummary.settings``) each seed has its own of: its learner seed, and
what a driver sets per run (the arm's state directories under the seed's, which summaries written on
2026-12-05 and 2026-12-06 recorded)."""
MAX_SHOWN = 6
"""Differences named in the refusal; the rest are counted."""


class MixedRuns(ConfigError):
    """Seeds of one results directory ran different scenarios or settings."""


def differences(runs: list[Run]) -> list[str]:
    """What sets each run after the first apart from the first: ``<seed dir>: experiment.<field>`` for a
    scenario field, ``<seed dir> <arm>: <key>: <first> -> <its>`` for an arm's recorded settings
    (:func:`~apps.experiments.resume.setting_differences`: a setting one summary does not record counts
    at its default; runs whose summary records none, from before 2026-12-04, are not compared)."""
    if len(runs) < 2:
        return []
    first = runs[0]
    base = _scenario(first)
    base_settings = {name: _settings(arm.summary) for name, arm in first.arms.items()}
    found = []
    for run in runs[1:]:
        own = _scenario(run)
        found += [f"{run.directory.name}: experiment.{key} differs from {first.directory.name}'s"
                  for key in sorted(base.keys() | own.keys()) if base.get(key) != own.get(key)]
        for name, arm in run.arms.items():
            theirs, ours = base_settings.get(name), _settings(arm.summary)
            if theirs and ours:
                found += [f"{run.directory.name} {name}: {line}" for line in setting_differences(theirs, ours)]
    return found


def refuse_mixed(runs: list[Run]) -> None:
    """:class:`MixedRuns` naming what differs, when the runs are not seeds of one experiment."""
    found = differences(runs)
    if found:
        more = len(found) - MAX_SHOWN
        shown = "; ".join(found[:MAX_SHOWN]) + (f"; and {more} more" if more > 0 else "")
        raise MixedRuns(f"the seed directories of {runs[0].directory.parent} did not run one experiment, and one "
                        f"report would average them as one: {shown}. Put the runs of each setting in a results "
                        f"directory of their own")


def _scenario(run: Run) -> dict[str, Any]:
    return {k: v for k, v in scenario_fields(run.scenario).items() if k not in PER_SEED_SCENARIO_FIELDS}


def _settings(summary) -> dict[str, Any]:
    return {} if summary is None else {k: v for k, v in summary.settings.items() if k not in PER_SEED_SETTINGS}
