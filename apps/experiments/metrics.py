"""Metrics of the drifting-preference experiment: pure functions of per-rollout series.

Series are indexed by rollout (0-based, dense). ``window`` is the moving-average
window W (``experiment.metrics_window``). A switch at rollout s starts a segment that
ends at the next switch (or the end of the run), exclusive.

* pre-switch level: mean reward of the W rollouts before s (fewer if s < W).
* adaptation lag: rollouts after s until the moving reward -- the mean of the last W
  rollouts, all of them after s -- first reaches ``recover`` (90%) of the pre-switch
  level: the smallest t - s + 1 (t in the segment, t >= s + W - 1) with
  mean(r[t-W+1 .. t]) >= recover x pre. At least W; None when the segment ends first.
  A pre-switch level of 0 or below is recovered by any full window.
* level reached: mean reward of the segment's last W rollouts (all of it if shorter).
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

RECOVER_SHARE = 0.9
"""The lag counts rollouts until the moving reward is back at this share of its pre-switch level."""


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


def pre_switch_level(rewards: Sequence[float], switch: int, window: int) -> float:
    """Mean reward of the ``window`` rollouts before ``switch``."""
    if not 0 < switch <= len(rewards):
        raise ValueError(f"switch {switch} outside 1..{len(rewards)}")
    return _mean(rewards[max(0, switch - window):switch])


def adaptation_lag(rewards: Sequence[float], switch: int, window: int, end: int | None = None,
                   recover: float = RECOVER_SHARE) -> int | None:
    """Rollouts after ``switch`` until the post-switch moving reward recovers; None if not before ``end``."""
    end = len(rewards) if end is None else min(end, len(rewards))
    target = recover * pre_switch_level(rewards, switch, window)
    for t in range(switch + window - 1, end):
        if _mean(rewards[t - window + 1:t + 1]) >= target:
            return t - switch + 1
    return None


def level_reached(rewards: Sequence[float], switch: int, window: int, end: int | None = None) -> float | None:
    """Mean reward of the last ``window`` rollouts of the segment [switch, end); None if it is empty."""
    end = len(rewards) if end is None else min(end, len(rewards))
    if end <= switch:
        return None
    return _mean(rewards[max(switch, end - window):end])


@dataclass(frozen=True)
class SwitchMetrics:
    switch: int
    pre_level: float
    lag: int | None
    level: float | None


def switch_metrics(rewards: Sequence[float], switches: Sequence[int], window: int) -> list[SwitchMetrics]:
    """Pre-switch level, adaptation lag and level reached for each switch (segments end at the next one)."""
    ends = list(switches[1:]) + [len(rewards)]
    out = []
    for switch, end in zip(switches, ends):
        if switch >= len(rewards):
            out.append(SwitchMetrics(switch, math.nan, None, None))
            continue
        out.append(SwitchMetrics(switch, pre_switch_level(rewards, switch, window),
                                 adaptation_lag(rewards, switch, window, end),
                                 level_reached(rewards, switch, window, end)))
    return out


@dataclass(frozen=True)
class Collapse:
    collapsed: bool
    at_rollout: int | None
    reason: str


def detect_collapse(rewards: Sequence[float], quality: Sequence[float], window: int,
                    fraction: float) -> Collapse:
    """See the module docstring."""
    if len(rewards) != len(quality):
        raise ValueError(f"{len(rewards)} rewards but {len(quality)} quality values")
    for i, (r, q) in enumerate(zip(rewards, quality)):
        if not (math.isfinite(r) and math.isfinite(q)):
            return Collapse(True, i, f"non-finite reward or quality at rollout {i}")
    if len(quality) < 2 * window:
        return Collapse(False, None, f"too short to tell ({len(quality)} rollouts < 2 windows)")
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
