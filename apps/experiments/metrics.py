"""Metrics of the drifting-preference experiment: pure functions of per-rollout series.

Series are indexed by rollout (0-based, dense). ``window`` is the moving-average
window W (``experiment.metrics_window``). The schedule cuts a run into phases: phase
k runs from its first rollout to the next phase's first rollout (or the end of the
run), exclusive. Every measure below compares arms on the same absolute scale, so an
arm that never learned the previous style gets no credit for "recovering" to its own
low level (the issue with a lag relative to the pre-switch level):

* level: mean reward of the phase's last quarter (LEVEL_SHARE of its rollouts, at
  least one): where the arm stands when the preference is about to move again.
* re-alignment lag: rollouts from the phase's start until the moving reward -- the
  mean of the last W rollouts, all of them inside the phase -- first reaches an
  absolute ``threshold`` (``experiment.realign_threshold``): the smallest
  t - start + 1 (t in the phase, t >= start + W - 1) with mean(r[t-W+1 .. t]) >=
  threshold. At least W; None when the phase ends first.
* area: the area under the phase's reward curve per rollout (rectangle rule), that is
  the phase's mean reward: how much reward the arm earned while it re-aligned.
* collapse: the answers themselves degrade -- not the reward, which a style switch
  legitimately drops while the policy re-aligns. A run collapses at rollout t0 when
  the moving quality (judge quality, trailing W) stays below ``fraction`` of its
  first full window's level from t0 to the end, for at least W rollouts; or at the
  first non-finite reward or quality.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LEVEL_SHARE = 0.25
"""A phase's level is the mean reward of this share of its rollouts, its last ones: late enough to
show where the arm got to, long enough (25 of 100 rollouts) that one lucky answer does not decide it."""


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean of the last ``window`` values at each index (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def phase_bounds(starts: Sequence[int], length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each phase from the phases' first rollouts; phases that begin at or
    after ``length`` (the rollouts there are) are cut to empty ranges ``(length, length)``."""
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"phase starts must begin at 0 and increase, got {list(starts)}")
    ends = list(starts[1:]) + [length]
    return [(min(s, length), min(e, length)) for s, e in zip(starts, ends)]


def phase_level(rewards: Sequence[float], start: int, end: int, share: float = LEVEL_SHARE) -> float | None:
    """Mean reward of the last ``share`` of the rollouts in ``[start, end)`` (at least one); None if empty."""
    end = min(end, len(rewards))
    if end <= start:
        return None
    tail = max(1, math.ceil(share * (end - start)))
    return _mean(rewards[end - tail:end])


def realign_lag(rewards: Sequence[float], start: int, end: int, window: int, threshold: float) -> int | None:
    """Rollouts from ``start`` until the in-phase moving reward reaches ``threshold``; None if not before ``end``."""
    end = min(end, len(rewards))
    for t in range(start + window - 1, end):
        if _mean(rewards[t - window + 1:t + 1]) >= threshold:
            return t - start + 1
    return None


def phase_area(rewards: Sequence[float], start: int, end: int) -> float | None:
    """Area under the reward curve of ``[start, end)`` per rollout (the phase's mean reward); None if empty."""
    end = min(end, len(rewards))
    return _mean(rewards[start:end]) if end > start else None


@dataclass(frozen=True)
class PhaseMetrics:
    start: int
    end: int
    style: str
    level: float | None
    lag: int | None
    area: float | None


def phase_metrics(rewards: Sequence[float], starts: Sequence[int], styles: Sequence[str], window: int,
                  threshold: float) -> list[PhaseMetrics]:
    """Level, re-alignment lag and area of every phase (see the module docstring)."""
    if len(starts) != len(styles):
        raise ValueError(f"{len(starts)} phase starts but {len(styles)} styles")
    return [PhaseMetrics(start, end, style, phase_level(rewards, start, end),
                         realign_lag(rewards, start, end, window, threshold), phase_area(rewards, start, end))
            for (start, end), style in zip(phase_bounds(starts, len(rewards)), styles)]


def post_switch_mean(rewards: Sequence[float], first_switch: int) -> float | None:
    """Mean reward from the first preference switch to the end (None if the run ends before it)."""
    return _mean(rewards[first_switch:]) if len(rewards) > first_switch else None


def lag_measurable(start: int, end: int, window: int) -> bool:
    """Whether ``[start, end)`` holds a full window, so that :func:`realign_lag` can find a lag in it:
    a shorter phase's None says nothing about the arm."""
    return end - start >= window


@dataclass(frozen=True)
class Collapse:
    collapsed: bool
    at_rollout: int | None
    reason: str
    measurable: bool = True
    """False when the run is too short to tell (under two windows): ``collapsed`` is False then
    without having been checked."""


def detect_collapse(rewards: Sequence[float], quality: Sequence[float], window: int,
                    fraction: float) -> Collapse:
    """See the module docstring."""
    if len(rewards) != len(quality):
        raise ValueError(f"{len(rewards)} rewards but {len(quality)} quality values")
    for i, (r, q) in enumerate(zip(rewards, quality)):
        if not (math.isfinite(r) and math.isfinite(q)):
            return Collapse(True, i, f"non-finite reward or quality at rollout {i}")
    if len(quality) < 2 * window:
        return Collapse(False, None, f"too short to tell ({len(quality)} rollouts < 2 windows)", measurable=False)
    moving = moving_average(quality, window)
    floor = fraction * moving[window - 1]
    start = None
    for t in range(len(moving) - 1, window - 1, -1):
        if moving[t] >= floor:
            break
        start = t
    if start is not None and len(moving) - start >= window:
        return Collapse(True, start, f"moving quality below {fraction:.0%} of its first window "
                                     f"({floor:.3f}) from rollout {start} to the end")
    return Collapse(False, None, "no collapse")


def style_shares(sampled: Sequence[str | None], styles: Sequence[str], block: int) -> list[dict[str, float]]:
    """Share of each style among the sampled answers of consecutive blocks of ``block`` rollouts
    (the last block may be shorter); answers without a known style count in no share."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    out = []
    for i in range(0, len(sampled), block):
        chunk = sampled[i:i + block]
        out.append({s: sum(1 for x in chunk if x == s) / len(chunk) for s in styles})
    return out


def segment_moving_average(values: Sequence[float], segments: Sequence[str | None], segment: str,
                           window: int) -> list[float | None]:
    """At each rollout t, the mean of ``segment``'s last ``window`` values among rollouts 0..t (fewer
    at the start); None before its first rollout. One point per rollout of the whole run, so the
    segments' curves (and several seeds' draws) share one axis."""
    if len(values) != len(segments):
        raise ValueError(f"{len(values)} values but {len(segments)} segments")
    own = [v for v, s in zip(values, segments) if s == segment]
    moving = moving_average(own, window)
    out: list[float | None] = []
    seen = 0
    for s in segments:
        seen += s == segment
        out.append(moving[seen - 1] if seen else None)
    return out


@dataclass(frozen=True)
class SegmentPhase:
    """One phase of a segment's own schedule: its rollouts of the run in ``[start, end)``."""

    start: int
    end: int
    style: str
    rollouts: int
    """The segment's rollouts in the phase."""
    level: float | None
    """Mean value of the last LEVEL_SHARE of those rollouts (at least one); None without any."""
    area: float | None
    """Mean value of all of them (the area under the segment's curve per rollout)."""


def segment_phase_metrics(values: Sequence[float], segments: Sequence[str | None], segment: str,
                          starts: Sequence[int], styles: Sequence[str]) -> list[SegmentPhase]:
    """Level and area of ``segment``'s rollouts in each phase of its schedule (``starts``, ``styles``:
    the phases' first rollouts and styles, in the run's rollouts)."""
    if len(values) != len(segments):
        raise ValueError(f"{len(values)} values but {len(segments)} segments")
    if len(starts) != len(styles):
        raise ValueError(f"{len(starts)} phase starts but {len(styles)} styles")
    out = []
    for (start, end), style in zip(phase_bounds(starts, len(values)), styles):
        own = [v for v, s in zip(values[start:end], segments[start:end]) if s == segment]
        out.append(SegmentPhase(start, end, style, len(own), phase_level(own, 0, len(own)),
                                phase_area(own, 0, len(own))))
    return out
