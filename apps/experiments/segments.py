"""The report's per-segment part, for a scenario with user segments (``experiment.segments``).

Every judged rollout carries the segment its request came from (RewardRow.segment). Per arm
and segment: the moving reward over the segment's own rollouts, on the run's rollout axis
(metrics.segment_moving_average), and the level and mean reward of each phase of the
segment's own schedule (metrics.segment_phase_metrics). Over seeds: the mean with a 95%
bootstrap interval, as the rest of the report (each seed draws its own segments, so a
seed's phase holds a slightly different number of the segment's rollouts; the table gives
their mean).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from apps.config import ExperimentConfig, UserSegment
from apps.experiments.aggregate import Band, Run, band
from apps.experiments.intervals import Interval, cell
from apps.experiments.intervals import interval as across_seeds
from apps.experiments.metrics import LEVEL_SHARE, SegmentPhase, segment_moving_average, segment_phase_metrics
from apps.experiments.plots import draw_band

SEGMENTS_PNG = "rewards_per_segment.png"
SEGMENTS_JSON = "segments.json"


@dataclass(frozen=True)
class SegmentPhaseSummary:
    style: str
    start: int
    end: int
    rollouts: float
    """The segment's rollouts in the phase, mean over seeds."""
    level: Interval | None
    area: Interval | None


@dataclass(frozen=True)
class SegmentSummary:
    arm: str
    segment: str
    share: float
    seeds: int
    phases: list[SegmentPhaseSummary]
    per_seed: list[list[SegmentPhase]]
    per_seed_seeds: list[int]
    """The ``experiment.seed`` of each ``per_seed`` entry (to pair them across arms: an arm may lack a seed)."""


def _series(run: Run, arm: str) -> tuple[list[float], list[str | None]]:
    rows = run.arms[arm].rewards
    return [r.judge_value for r in rows], [r.segment for r in rows]


def summarize_segment(runs: list[Run], arm: str, segment: UserSegment) -> SegmentSummary:
    """One arm's phase levels of one segment: per seed, and their mean and interval over seeds."""
    starts = [p.from_rollout for p in segment.schedule]
    styles = [p.style for p in segment.schedule]
    ran = [run for run in runs if arm in run.arms]
    per_seed = [segment_phase_metrics(*_series(run, arm), segment.name, starts, styles) for run in ran]
    phases = []
    for k, (start, style) in enumerate(zip(starts, styles)):
        cells = [seed[k] for seed in per_seed]
        phases.append(SegmentPhaseSummary(style, start, cells[0].end, sum(c.rollouts for c in cells) / len(cells),
                                          across_seeds([c.level for c in cells]),
                                          across_seeds([c.area for c in cells])))
    return SegmentSummary(arm, segment.name, segment.share, len(per_seed), phases, per_seed,
                          [run.scenario.seed for run in ran])


def summarize_segments(runs: list[Run], arms: list[str]) -> list[SegmentSummary]:
    """Every (arm, segment) pair of the scenario's segments; empty without segments."""
    scenario = runs[0].scenario
    return [summarize_segment(runs, arm, segment) for arm in arms for segment in scenario.segments
            if any(arm in run.arms for run in runs)]


def segment_reward_band(runs: list[Run], arm: str, segment: str, window: int) -> Band | None:
    """The segment's moving reward per rollout, over seeds, from the first rollout at which every
    seed has seen the segment."""
    curves = [segment_moving_average(*_series(run, arm), segment, window) for run in runs if arm in run.arms]
    curves = [c for c in curves if any(v is not None for v in c)]
    if not curves:
        return None
    first = max(next(i for i, v in enumerate(c) if v is not None) for c in curves)
    length = min(len(c) for c in curves)
    return band([c[first:length] for c in curves], list(range(first, length)))


def segment_markdown(summaries: list[SegmentSummary], scenario: ExperimentConfig) -> list[str]:
    """The report's per-segment section (no lines without segments)."""
    if not summaries:
        return []
    lines = ["", "## User segments", "",
             "Each request drew its user segment (its share below, seeded) and was scored against that segment's own "
             "schedule; the policy never sees the segment (the OpenAI `user` field is not in the prompt), so one "
             "policy serves every segment. Per arm and segment, each phase of the segment's schedule: level (mean "
             f"reward of the segment's last {LEVEL_SHARE:.0%} of rollouts in the phase), mean (over all of them) and "
             "rollouts (the segment's rollouts in the phase, mean over seeds; a seed with none gives no level or "
             "mean, and the cell says over how many seeds it is). The tables above cut the run by "
             "`experiment.schedule` and mix every segment's rewards.", ""]
    for segment in scenario.segments:
        schedule = ", ".join(f"{p.style} from rollout {p.from_rollout}" for p in segment.schedule)
        lines.append(f"- `{segment.name}` (share {segment.share:g}): {schedule}")
    for segment in scenario.segments:
        rows = [s for s in summaries if s.segment == segment.name]
        heads = [f"{p.style} {p.start}-{p.end - 1}" for p in rows[0].phases]
        lines += ["", f"### Segment {segment.name}: level / mean / rollouts per phase", "",
                  "| arm | " + " | ".join(heads) + " |", "|" + "---|" * (len(heads) + 1)]
        # "(n of N seeds)": seeds where the segment had no rollout in the phase give no level
        lines += ["| " + " | ".join([s.arm, *(f"{cell(p.level, of=s.seeds)} / {cell(p.area, of=s.seeds)} / "
                                              f"{p.rollouts:.1f}" for p in s.phases)]) + " |" for s in rows]
    lines += ["", f"![moving reward per user segment]({SEGMENTS_PNG})", ""]
    return lines


def plot_rewards_per_segment(runs: list[Run], arms: list[str], path: Path) -> None:
    """Per arm: one moving-reward line per segment (band over seeds), each segment's switches marked
    in its colour."""
    scenario = runs[0].scenario
    w = scenario.metrics_window
    fig = Figure(figsize=(9, 2.6 * len(arms)), layout="constrained")
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    for ax, arm in zip(axes, arms):
        for k, segment in enumerate(scenario.segments):
            color = f"C{k}"
            b = segment_reward_band(runs, arm, segment.name, w)
            if b is not None:
                draw_band(ax, b, f"{segment.name}\n(moving mean of its\nlast {w} rollouts)", color=color)
            for phase in segment.schedule[1:]:
                ax.axvline(phase.from_rollout, color=color, linestyle="--", linewidth=1)
                ax.text(phase.from_rollout, 1.0 - 0.08 * k, f" {segment.name}: {phase.style}", color=color,
                        transform=ax.get_xaxis_transform(), va="top", fontsize=7)
        seeds = sum(arm in run.arms for run in runs)
        ax.set_title(arm + (f" (mean of {seeds} seeds, 95% band)" if seeds > 1 else ""), fontsize=10)
        ax.set(ylabel="reward", ylim=(-0.05, 1.05))
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes[-1].set_xlabel("rollout")
    fig.savefig(path, dpi=100)


def write_segment_report(runs: list[Run], arms: list[str], out_dir: Path) -> list[str]:
    """With segments: the per-segment plot and ``segments.json`` into ``out_dir``; returns the
    report's per-segment section (nothing written, no lines, without segments)."""
    if not runs[0].scenario.segments:
        return []
    summaries = summarize_segments(runs, arms)
    plot_rewards_per_segment(runs, arms, out_dir / SEGMENTS_PNG)
    (out_dir / SEGMENTS_JSON).write_text(json.dumps([asdict(s) for s in summaries], indent=2) + "\n")
    return segment_markdown(summaries, runs[0].scenario)
