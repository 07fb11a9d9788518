"""The report's numbers: each arm's measures per seed, and their mean and 95% bootstrap interval
over seeds (experiments/intervals.py). Pure functions of the results files' contents.

A results directory holds one run (``<arm>.jsonl`` files beside ``scenario.json``) or, after
``simulate --seeds N``, one run per ``seed-<k>/`` directory: :func:`load_runs` reads either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from apps.config import ExperimentConfig
from apps.experiments.intervals import Interval, bootstrap_band, interval
from apps.experiments.metrics import (Collapse, PhaseMetrics, detect_collapse, moving_average, phase_metrics,
                                      post_switch_mean, style_shares)
from apps.experiments.results import SCENARIO_FILE, SEED_DIR, ArmResults, read_arm, read_scenario
from apps.experiments.same_scenario import refuse_mixed


@dataclass(frozen=True)
class Run:
    """One seed of the scenario: its scenario (seeds resolved) and its arms' results."""

    directory: Path
    scenario: ExperimentConfig
    arms: dict[str, ArmResults]
    """The arms whose run finished."""
    unfinished: dict[str, int] = field(default_factory=dict)
    """Arms whose run is under way or was cut short -> rollouts judged so far; not in ``arms``."""


def _read_run(directory: Path) -> Run:
    """A run's finished arms, and those it left out: an arm without a summary (which marks a finished run:
    results.finished_summary) and short of the scenario's rollouts is under way or was cut short,
    and its phases would be read as if complete. Files from before summaries marked a finished run
    count by their rollouts alone."""
    scenario = read_scenario(directory)
    arms, unfinished = {}, {}
    for path in sorted(directory.glob("*.jsonl")):
        arm = read_arm(path)
        if arm.summary is None and len(arm.rewards) < scenario.rollouts_per_arm:  # read_arm read it
            unfinished[arm.name] = len(arm.rewards)
        else:
            arms[arm.name] = arm
    return Run(directory, scenario, arms, unfinished)


class NoResults(FileNotFoundError):
    """A results directory that is not there or holds no arm's results."""


def load_runs(results_dir: Path) -> list[Run]:
    """The runs of ``results_dir``: its ``seed-<k>/`` directories in seed order, or itself (:class:`NoResults`
    when there are none; :class:`~apps.experiments.same_scenario.MixedRuns` when its seeds ran different
    scenarios or settings)."""
    if not results_dir.is_dir():
        raise NoResults(f"no experiment results in {results_dir}: it does not exist")
    seeded = sorted((p for p in results_dir.iterdir() if p.is_dir() and SEED_DIR.match(p.name)
                     and (p / SCENARIO_FILE).is_file()), key=lambda p: int(SEED_DIR.match(p.name).group(1)))
    if not (seeded or (results_dir / SCENARIO_FILE).is_file()):
        raise NoResults(f"no experiment results in {results_dir}: no {SCENARIO_FILE} there or in a seed-<k>/ in it")
    runs = [_read_run(p) for p in seeded] if seeded else [_read_run(results_dir)]
    refuse_mixed(runs)
    if not any(run.arms for run in runs):
        left = unfinished_runs(runs)
        raise NoResults(f"no per-arm results (*.jsonl) in {results_dir}" if not left else
                        f"no finished arm runs in {results_dir}; not finished: {'; '.join(left)}")
    return runs


def unfinished_runs(runs: list[Run]) -> list[str]:
    """``<seed directory> <arm> (<n> of <N> rollouts)`` for every run left out as unfinished."""
    return [f"{run.directory.name} {name} ({count} of {run.scenario.rollouts_per_arm} rollouts)"
            for run in runs for name, count in run.unfinished.items()]


@dataclass(frozen=True)
class SeedMetrics:
    """One arm's measures in one seed."""

    seed: int
    """The scenario's seed: report.json's per-seed rows are paired by it (an arm missing from one seed
    shifts every later row of a list read by position)."""
    rollouts: int
    mean_reward: float | None
    post_switch_mean: float | None
    phases: list[PhaseMetrics]
    collapse: Collapse
    final_style_accuracy: float | None
    group_wait_s: float | None
    incomplete_groups: int | None
    rollbacks: int | None
    drift_restarts: int | None
    drift_rollbacks: int | None


def seed_metrics(arm: ArmResults, scenario: ExperimentConfig) -> SeedMetrics:
    rewards = [r.judge_value for r in arm.rewards]
    starts = [p.from_rollout for p in scenario.schedule]
    summary = arm.summary
    return SeedMetrics(
        seed=scenario.seed, rollouts=len(rewards), mean_reward=sum(rewards) / len(rewards) if rewards else None,
        post_switch_mean=post_switch_mean(rewards, scenario.switch_rollouts[0]),
        phases=phase_metrics(rewards, starts, [p.style for p in scenario.schedule], scenario.metrics_window,
                             scenario.realign_threshold),
        collapse=detect_collapse(rewards, [r.quality for r in arm.rewards], scenario.metrics_window,
                                 scenario.collapse_fraction),
        final_style_accuracy=arm.evals[-1].style_accuracy if arm.evals else None,
        group_wait_s=summary.group_wait_s if summary else None,
        incomplete_groups=summary.incomplete_groups if summary else None,
        rollbacks=summary.rollbacks if summary else None,
        drift_restarts=summary.drift_restarts if summary else None,
        drift_rollbacks=summary.drift_rollbacks if summary else None)


@dataclass(frozen=True)
class PhaseSummary:
    style: str
    start: int
    end: int
    level: Interval | None
    lag: Interval | None
    """Over the seeds that reached the threshold within the phase (``lag_reached`` of ``seeds``)."""
    lag_reached: int
    area: Interval | None


@dataclass(frozen=True)
class ArmSummaryAcrossSeeds:
    name: str
    seeds: int
    rollouts: int
    mean_reward: Interval | None
    post_switch_mean: Interval | None
    phases: list[PhaseSummary]
    collapsed: int
    """Seeds in which the arm collapsed."""
    realigned: int
    """Seeds in which the moving reward reached the re-alignment threshold in every phase after a switch."""
    final_style_accuracy: Interval | None
    group_wait_s: Interval | None
    incomplete_groups: Interval | None
    rollbacks: Interval | None
    drift_restarts: Interval | None
    drift_rollbacks: Interval | None
    per_seed: list[SeedMetrics]


def summarize_arm(name: str, per_seed: list[SeedMetrics], scenario: ExperimentConfig) -> ArmSummaryAcrossSeeds:
    """Mean and bootstrap interval over seeds of every measure of one arm."""
    phases = []
    for k, phase in enumerate(scenario.schedule):
        cells = [m.phases[k] for m in per_seed]
        lags = [c.lag for c in cells if c.lag is not None]
        phases.append(PhaseSummary(phase.style, cells[0].start, cells[0].end, interval([c.level for c in cells]),
                                   interval(lags), len(lags), interval([c.area for c in cells])))
    return ArmSummaryAcrossSeeds(
        name=name, seeds=len(per_seed), rollouts=min(m.rollouts for m in per_seed),
        mean_reward=interval([m.mean_reward for m in per_seed]),
        post_switch_mean=interval([m.post_switch_mean for m in per_seed]), phases=phases,
        collapsed=sum(m.collapse.collapsed for m in per_seed),
        realigned=sum(all(p.lag is not None for p in m.phases[1:]) for m in per_seed),
        final_style_accuracy=interval([m.final_style_accuracy for m in per_seed]),
        group_wait_s=interval([m.group_wait_s for m in per_seed]),
        incomplete_groups=interval([m.incomplete_groups for m in per_seed]),
        rollbacks=interval([m.rollbacks for m in per_seed]),
        drift_restarts=interval([m.drift_restarts for m in per_seed]),
        drift_rollbacks=interval([m.drift_rollbacks for m in per_seed]), per_seed=per_seed)


def arm_names(runs: list[Run], scenario: ExperimentConfig) -> list[str]:
    """Arms present in any run: the scenario's order first, then others by name."""
    order = {a.name: i for i, a in enumerate(scenario.arms)}
    return sorted({name for run in runs for name in run.arms}, key=lambda n: (order.get(n, len(order)), n))


def summarize(runs: list[Run]) -> list[ArmSummaryAcrossSeeds]:
    """Every arm's summary over the runs that have it."""
    scenario = runs[0].scenario
    return [summarize_arm(name, [seed_metrics(run.arms[name], run.scenario) for run in runs if name in run.arms],
                          scenario) for name in arm_names(runs, scenario)]


def paired_difference(runs: list[Run], reference: str, other: str) -> Interval | None:
    """``reference``'s post-switch mean minus ``other``'s, seed by seed over the runs that have both,
    and the 95% bootstrap interval of the mean difference. Every arm of a seed gets the same
    traffic (prompts, arrival times, dropped rewards), so pairing by seed takes what a seed does
    to every arm out of the comparison; the unpaired intervals keep it in."""
    return interval([a - b for a, b in _post_switch_pairs(runs, reference, other)])


def on_common_seeds(runs: list[Run], reference: str, other: str) -> tuple[Interval | None, Interval | None]:
    """Each arm's post-switch mean and 95% bootstrap interval over the seeds where both have one:
    an unpaired comparison on one set of seeds (over each arm's own seeds, a seed only one of them
    ran moves that arm's mean alone, by as much as the seed differs from the others)."""
    pairs = _post_switch_pairs(runs, reference, other)
    return interval([a for a, _ in pairs]), interval([b for _, b in pairs])


def _post_switch_pairs(runs: list[Run], reference: str, other: str) -> list[tuple[float, float]]:
    """(reference's, other's) post-switch mean of each seed where both arms have one."""
    pairs = []
    for run in runs:
        if reference in run.arms and other in run.arms:
            start = run.scenario.switch_rollouts[0]
            a, b = (post_switch_mean([r.judge_value for r in run.arms[name].rewards], start)
                    for name in (reference, other))
            if a is not None and b is not None:
                pairs.append((a, b))
    return pairs


def _stack_curves(curves: list[list[float]]) -> np.ndarray:
    """``[seeds, T]`` over the common length (seeds' runs can differ by a few rollouts)."""
    length = min(len(c) for c in curves)
    return np.array([c[:length] for c in curves], dtype=np.float64)


@dataclass(frozen=True)
class Band:
    """A curve's mean over seeds and its pointwise 95% bootstrap band (``x`` rollouts)."""

    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: np.ndarray
    """``[seeds, T]``: each seed's curve."""


def band(curves: list[list[float]], x: list[int] | None = None) -> Band | None:
    curves = [c for c in curves if c]
    if not curves:
        return None
    values = _stack_curves(curves)
    low, high = bootstrap_band(values)
    xs = np.arange(values.shape[1]) if x is None else np.asarray(x[:values.shape[1]])
    return Band(xs, values.mean(axis=0), low, high, values)


def moving_reward_band(runs: list[Run], arm: str, window: int) -> Band | None:
    return band([moving_average([r.judge_value for r in run.arms[arm].rewards], window)
                 for run in runs if arm in run.arms])


def style_accuracy_band(runs: list[Run], arm: str) -> Band | None:
    evals = [run.arms[arm].evals for run in runs if arm in run.arms and run.arms[arm].evals]
    if not evals:
        return None
    shortest = min(evals, key=len)
    return band([[e.style_accuracy for e in ev] for ev in evals], [e.rollout for e in shortest])


def style_share_curves(runs: list[Run], arm: str, styles: list[str], block: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(block start rollouts, style -> share among the block's sampled answers, mean over seeds)."""
    per_seed = [style_shares([r.sampled_style for r in run.arms[arm].rewards], styles, block)
                for run in runs if arm in run.arms]
    blocks = min(len(s) for s in per_seed) if per_seed else 0
    shares = {s: np.array([[seed[b][s] for b in range(blocks)] for seed in per_seed]).mean(axis=0)
              if blocks else np.zeros(0) for s in styles}
    return np.arange(blocks) * block, shares
