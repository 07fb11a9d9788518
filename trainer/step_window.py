"""The learner's metrics on their way to MLflow: the cycles between two logs
(``mlflow.log_every_steps``), and the logs MLflow has not taken yet."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag

METRICS_PER_BATCH = 1000
"""MLflow accepts at most 1000 metrics per log_batch call."""
TAGS_PER_BATCH = 100
"""MLflow accepts at most 100 tags per log_batch call."""


STEP_FLAGS = frozenset({"critic_rewarm", "nonfinite_inputs", "refused_after_update", "skipped_nonfinite"})
"""0/1 figures the learning rules report only on the steps they are set on (a re-warm step, a refused
one): a step without one counts as 0 in the window's mean, which is then the share of steps it was set
on, as a flag every step reports (``drift_alarm``) gives. Averaged over only the steps that reported
it, one re-warm step in ten logged ``critic_rewarm`` 1."""


class Taken(NamedTuple):
    """What a window logs."""

    step: int
    """The newest step gathered: the step the metrics are logged at."""
    metrics: dict[str, float]
    tags: dict[str, str]
    """Run tags whose newest value differs from what the last take gave (all of them at the first)."""


class StepWindow:
    """The learner's cycles since the last log to MLflow (``mlflow.log_every_steps``): the mean
    of each per-step figure over the steps that gave a number for it (NaN: none did), the
    newest readings, and the newest value of each run tag that changed since the last log. With
    one step per window it logs what the step gave."""

    def __init__(self) -> None:
        self.step: int | None = None
        """The newest step gathered (None: nothing since the last log)."""
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        """Steps that gave a number (not NaN) for each averaged figure."""
        self._steps = 0
        """Steps gathered: the denominator of a :data:`STEP_FLAGS` flag's share."""
        self._latest: dict[str, float] = {}
        self._tags: dict[str, str] = {}
        self._tags_taken: dict[str, str] = {}
        """Each tag's value as a take last gave it: a tag that keeps its value is not sent again."""

    def add(self, step: int, averaged: dict[str, float], latest: dict[str, float],
            tags: Mapping[str, str] | None = None) -> None:
        self.step = step
        self._steps += 1
        for key, value in averaged.items():
            value = float(value)
            self._sums.setdefault(key, 0.0)
            self._counts.setdefault(key, 0)
            if not math.isnan(value):
                self._sums[key] += value
                self._counts[key] += 1
        self._latest = {k: float(v) for k, v in latest.items()}
        self._tags.update(tags or {})

    def take(self) -> Taken | None:
        """The window's step, metrics and changed tags, and the window starts afresh; None if empty."""
        if self.step is None:
            return None
        means = {k: self._sums[k] / n if (n := self._steps if k in STEP_FLAGS else self._counts[k]) else math.nan
                 for k in self._sums}
        tags = {k: v for k, v in self._tags.items() if self._tags_taken.get(k) != v}
        self._tags_taken.update(tags)
        taken = Taken(self.step, {**means, **self._latest}, tags)
        self.step, self._sums, self._counts, self._latest, self._tags = None, {}, {}, {}, {}
        self._steps = 0
        return taken


class Unsent:
    """Logs (metrics and run tags) MLflow has not taken yet, oldest first; beyond ``limit`` the
    oldest are dropped and counted, their tags carried over to the next (tags are the newest
    values, which a later log may not repeat)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.logs: deque[tuple[list[Metric], dict[str, str]]] = deque()
        self.dropped = 0

    def add(self, metrics: list[Metric], tags: Mapping[str, str]) -> None:
        self.logs.append((metrics, dict(tags)))
        if len(self.logs) > self.limit:
            tags_dropped = self.logs.popleft()[1]
            self.logs[0] = (self.logs[0][0], {**tags_dropped, **self.logs[0][1]})
            self.dropped += 1

    def send(self, client: MlflowClient, run_id: str) -> None:
        """Every log to ``run_id``, oldest first, its tags first; the MlflowException of a call that
        fails leaves what that log had not sent as the oldest, to send again. What was sent is taken
        off the log batch by batch: MLflow keeps both copies of a metric logged twice at one step
        (setting a tag twice is harmless, but a log's tags are sent before any of its metrics)."""
        while self.logs:
            metrics, tags = self.logs[0]
            if tags:
                items = [RunTag(k, v) for k, v in tags.items()]
                for start in range(0, len(items), TAGS_PER_BATCH):
                    client.log_batch(run_id, tags=items[start:start + TAGS_PER_BATCH])
                self.logs[0] = (metrics, {})
            while metrics:
                client.log_batch(run_id, metrics=metrics[:METRICS_PER_BATCH])
                metrics = metrics[METRICS_PER_BATCH:]
                self.logs[0] = (metrics, {})
            self.logs.popleft()
