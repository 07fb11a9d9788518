"""Detecting that the users' preference moved: a sustained drop of the reward stream.

A policy that has learned one preference concentrates on it; when the preference switches,
the newly preferred answers are almost never sampled and a gradient learner has next to no
signal to follow (docs/EXPERIMENTS.md, issue 14: 2.4% of sao's answers in the new style). A
change-point detector on the rewards the learner trains on tells the learner when its own
policy has become a poor starting point, so that it can restore its ability to explore
(trainer/plasticity.py). It is the restart of restart-based non-stationary bandits (Page's
test, CUSUM; Hinkley 1971) applied to a policy.

The test compares the mean of the ``recent`` newest rewards with the mean of the
``reference`` rewards before them:

``drop = mean(reference) - mean(recent)``, ``se = sqrt(var(reference)/n_ref + var(recent)/n_rec)``
(Welch's standard error, sample variances), ``z = drop / max(se, SE_FLOOR)``;

an alarm when ``drop >= min_drop`` and ``z >= z_threshold``. After an alarm the history is
cleared: the next alarm needs ``reference + recent`` new rewards. Only drops alarm: a rising
reward is the learner doing its job.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

SE_FLOOR = 1e-6
"""Smallest standard error used in ``z``: two windows of constant rewards (se 0) that differ by
at least ``min_drop`` are a drop, not a division by zero."""


@dataclass(frozen=True)
class DriftSettings:
    """The detector's part of the config (``drift.*``)."""

    recent: int
    reference: int
    min_drop: float
    z_threshold: float


def mean_shift(reference: list[float], recent: list[float]) -> tuple[float, float]:
    """Rewards before and the newest rewards (each at least 2) -> (drop, z) as in the module
    docstring: ``drop`` the fall of the mean, ``z`` it in standard errors."""
    if len(reference) < 2 or len(recent) < 2:
        raise ValueError(f"mean_shift needs at least 2 rewards in each window, got {len(reference)} and {len(recent)}")
    m_ref, m_rec = sum(reference) / len(reference), sum(recent) / len(recent)
    var_ref = sum((r - m_ref) ** 2 for r in reference) / (len(reference) - 1)
    var_rec = sum((r - m_rec) ** 2 for r in recent) / (len(recent) - 1)
    se = math.sqrt(var_ref / len(reference) + var_rec / len(recent))
    drop = m_ref - m_rec
    return drop, drop / max(se, SE_FLOOR)


class RewardDropDetector:
    """The two-window test of the module docstring over a stream of rewards."""

    def __init__(self, settings: DriftSettings) -> None:
        self.settings = settings
        self.history: deque[float] = deque(maxlen=settings.reference + settings.recent)
        self.alarm_reference: list[float] = []
        """The reference window of the newest alarm: the level a roll-back is judged against."""
        self.rewards_after_alarm = 0
        """How many of the last observed step's rewards came after the one that raised its alarm (0
        without an alarm). They go back into ``history``, which may not hold them all: a step with
        more than ``reference + recent`` of them keeps only the newest, so the alarm's position is
        counted here, not read off the history's length."""

    def observe(self, rewards: list[float]) -> tuple[bool, dict[str, float]]:
        """Add one step's rewards (in the order trained) and test. Returns (alarm, metrics
        ``drift_drop``, ``drift_z``: NaN until both windows are full)."""
        s = self.settings
        alarm, drop, z = False, math.nan, math.nan
        self.rewards_after_alarm = 0
        for i, reward in enumerate(rewards):
            self.history.append(float(reward))
            if len(self.history) < s.reference + s.recent:
                continue
            values = list(self.history)
            fell, drop, z = self.test(values[:s.reference], values[s.reference:])
            if fell:
                alarm = True
                self.alarm_reference = values[:s.reference]
                self.history.clear()  # the rewards before the change say nothing about after it
                break  # the rest of this step's rewards are the first of the new regime
        if alarm:
            self.rewards_after_alarm = len(rewards) - i - 1
            self.history.extend(float(r) for r in rewards[i + 1:])
        return alarm, {"drift_drop": drop, "drift_z": z, "drift_alarm": float(alarm)}

    def test(self, reference: list[float], recent: list[float]) -> tuple[bool, float, float]:
        """The two-window test on given windows: (the mean fell enough, drop, z)."""
        drop, z = mean_shift(reference, recent)
        return drop >= self.settings.min_drop and z >= self.settings.z_threshold, drop, z

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))
