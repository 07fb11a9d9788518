"""The queues and flags between the benchmark's main process and its two workers.

Per loop: each worker builds its state and reports ``("ready", role, loop, None)``;
the main process clears ``stop`` and sends each worker the loop's start time on
its own ``go`` queue; the learner sets ``stop`` when the loop is over; each
worker reports ``("done", role, loop, report)`` (a failure: ``("error", role, -1,
traceback)``). Messages on ``rollouts`` and ``weights`` carry their loop number so
a worker drops what an earlier loop left.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

GET_TIMEOUT_S = 0.05
"""Longest block on a queue before a worker looks at ``stop`` again."""


@dataclass
class Channels:
    rollouts: Any
    """Finished requests, generator -> learner."""
    weights: Any
    """Published versions, learner -> generator."""
    results: Any
    """ready / done / error messages, workers -> main."""
    go_generator: Any
    """The start time (``perf_counter``) of the next loop, main -> generator."""
    go_learner: Any
    """The same, main -> learner."""
    stop: Any
    """Set by the learner when the loop ends (and by main on an error)."""

    @classmethod
    def create(cls, ctx) -> "Channels":
        return cls(ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event())

    def go(self, role: str):
        return self.go_generator if role == "generator" else self.go_learner


def get_or_none(q, timeout_s: float = GET_TIMEOUT_S):
    """The next item of ``q``, or None after ``timeout_s``."""
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        return None


def drain(q) -> list:
    """Everything ``q`` holds right now, without blocking."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
