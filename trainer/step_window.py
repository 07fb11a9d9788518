"""The learner's cycles between two logs to MLflow (``mlflow.log_every_steps``)."""

from __future__ import annotations

import math


class StepWindow:
    """The learner's cycles since the last log to MLflow (``mlflow.log_every_steps``): the mean
    of each per-step figure over the steps that gave a number for it (NaN: none did), and the
    newest readings. With one step per window it logs what the step gave."""

    def __init__(self) -> None:
        self.step: int | None = None
        """The newest step gathered (None: nothing since the last log)."""
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        """Steps that gave a number (not NaN) for each averaged figure."""
        self._latest: dict[str, float] = {}

    def add(self, step: int, averaged: dict[str, float], latest: dict[str, float]) -> None:
        self.step = step
        for key, value in averaged.items():
            value = float(value)
            self._sums.setdefault(key, 0.0)
            self._counts.setdefault(key, 0)
            if not math.isnan(value):
                self._sums[key] += value
                self._counts[key] += 1
        self._latest = {k: float(v) for k, v in latest.items()}

    def take(self) -> tuple[int, dict[str, float]] | None:
        """(the newest step, the window's metrics), and the window starts afresh; None if empty."""
        if self.step is None:
            return None
        means = {k: self._sums[k] / n if (n := self._counts[k]) else math.nan for k in self._sums}
        taken = self.step, {**means, **self._latest}
        self.step, self._sums, self._counts, self._latest = None, {}, {}, {}
        return taken
