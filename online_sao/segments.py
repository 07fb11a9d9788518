"""Per-segment books with bounded cardinality (docs/DEPLOY.md, "Segments").

A segment is a group of requests an operator wants to see apart: by default the OpenAI
``user`` of a request, or a metadata field named in ``serving.segment_field``; it is logged
on the interaction record (``Interaction.segment``). Users are many, labels of a metrics
system must be few: :class:`SegmentCounter` keeps the ``top_n`` segments by traffic and
folds every other one into the label :data:`OTHER`, so at most ``top_n + 1`` labels ever
appear; records without a segment count as the segment :data:`NO_SEGMENT`.

Counting every distinct key exactly would grow without bound, so the counter is the
space-saving sketch: it holds ``TRACKED_PER_LABEL * top_n`` keys; a new key replaces the
least counted one and inherits its count (an overestimate by at most that count). Every
key whose share of the traffic exceeds ``1 / (TRACKED_PER_LABEL * top_n)`` is held, and the
held counts sum to the total, so :data:`OTHER` = total - the top ``top_n`` counts.

:class:`SegmentRewards` adds each segment's recent rewards and the named scores behind them
(``Reward.scores``, a judge's quality say: the learner's side).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

OTHER = "other"
"""The label of every segment outside the top N."""
NO_SEGMENT = "none"
"""The segment of a record that carries none. A segment key spelled ``other`` or ``none``
shares the label of that bucket."""
SEGMENT_MAX_CHARS = 256
"""Longest segment key a record may carry (the OpenAI ``user`` field is bounded alike)."""
TRACKED_PER_LABEL = 4
"""Keys the space-saving counter holds per label: a segment with more than
1 / (4 * top_n) of the traffic is never lost among the rarer ones."""
SCORE_NAMES_TRACKED = 16
"""Distinct score names a segment keeps (the first seen): each is a metric per label, so a source
that sent a new name with every reward must not grow the metrics without bound."""
METRIC_NAME_CHARS = 64
"""Longest segment part of an MLflow metric name (MLflow keys have at most 250 characters)."""


def segment_problem(key: str) -> str | None:
    """Why ``key`` cannot be a segment key (None when it can): 1 to SEGMENT_MAX_CHARS
    printable characters (no control characters, which labels and log lines cannot show)."""
    if not 1 <= len(key) <= SEGMENT_MAX_CHARS:
        return f"a segment key has 1 to {SEGMENT_MAX_CHARS} characters, this one {len(key)}"
    if not key.isprintable():
        return "a segment key must be printable text (no control characters)"
    return None


class SegmentCounter:
    """Traffic per segment, top ``top_n`` by count plus :data:`OTHER` (module docstring)."""

    def __init__(self, top_n: int) -> None:
        if top_n < 1:
            raise ValueError(f"top_n must be at least 1, got {top_n}")
        self.top_n = top_n
        self.capacity = TRACKED_PER_LABEL * top_n
        self.counts: dict[str, int] = {}
        """The held keys and their (over)estimated counts."""
        self.total = 0

    def observe(self, segment: str | None) -> None:
        """Count one request of ``segment`` (None: :data:`NO_SEGMENT`)."""
        key = NO_SEGMENT if segment is None else segment
        self.total += 1
        if key in self.counts:
            self.counts[key] += 1
            return
        if len(self.counts) >= self.capacity:
            smallest = min(self.counts, key=self.counts.__getitem__)
            floor = self.counts.pop(smallest)
            self.counts[key] = floor + 1
            return
        self.counts[key] = 1

    def top(self) -> list[str]:
        """The ``top_n`` held keys by count (ties: the key first in sort order), largest first."""
        return sorted(self.counts, key=lambda k: (-self.counts[k], k))[:self.top_n]

    def label(self, segment: str | None) -> str:
        """The label ``segment`` is shown under now: itself when in the top N, else :data:`OTHER`."""
        key = NO_SEGMENT if segment is None else segment
        return key if key in self.top() else OTHER

    def labelled_counts(self) -> dict[str, int]:
        """Requests per label: the top N and :data:`OTHER` (the rest; 0 when there is none)."""
        top = {key: self.counts[key] for key in self.top()}
        rest = self.total - sum(top.values())
        return {**top, OTHER: top.get(OTHER, 0) + rest}  # a key spelled "other" adds to the bucket


@dataclass(frozen=True)
class SegmentStat:
    """One label's recent rewards."""

    reward: float
    """Mean of the label's rewards in the window (NaN without any)."""
    count: int
    """Rewards in the window."""
    scores: dict[str, float] = field(default_factory=dict)
    """Mean of each named score over the label's newest ``window`` rewards that carried it."""


class SegmentRewards:
    """Rewards per segment: traffic decides the labels (:class:`SegmentCounter`); each label
    keeps its newest ``window`` rewards. A reward goes to the label its segment has when it
    arrives; a label that leaves the top N loses its rewards (they were counted under it)."""

    def __init__(self, top_n: int, window: int) -> None:
        self.counter = SegmentCounter(top_n)
        self.window = window
        self.rewards: dict[str, deque[float]] = {}
        self.scores: dict[str, dict[str, deque[float]]] = {}
        """label -> score name -> the newest ``window`` values."""

    def observe(self, segment: str | None, reward: float, scores: Mapping[str, float] | None = None) -> None:
        """One reward of ``segment`` and the named scores it carried."""
        self.counter.observe(segment)
        label = self.counter.label(segment)
        self.rewards.setdefault(label, deque(maxlen=self.window)).append(float(reward))
        label_scores = self.scores.setdefault(label, {})
        for name, value in (scores or {}).items():
            if name in label_scores or len(label_scores) < SCORE_NAMES_TRACKED:
                label_scores.setdefault(name, deque(maxlen=self.window)).append(float(value))
        kept = set(self.counter.top()) | {OTHER}
        for gone in [name for name in self.rewards if name not in kept]:
            del self.rewards[gone]
            self.scores.pop(gone, None)

    def stats(self) -> dict[str, SegmentStat]:
        """Each label's :class:`SegmentStat` (labels with rewards in the window only)."""
        return {label: SegmentStat(sum(values) / len(values) if values else math.nan, len(values),
                                   {name: sum(v) / len(v) for name, v in sorted(self.scores.get(label, {}).items())})
                for label, values in self.rewards.items()}

    def metrics(self) -> dict[str, float]:
        """``segment.<name>.reward``, ``segment.<name>.count`` and ``segment.<name>.score_<score>``
        per label (:func:`metric_name`)."""
        out: dict[str, float] = {}
        for label, stat in self.stats().items():
            name = metric_name(label)
            out[f"segment.{name}.reward"] = stat.reward
            out[f"segment.{name}.count"] = float(stat.count)
            out.update({f"segment.{name}.score_{score}": value for score, value in stat.scores.items()})
        return out


_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


def metric_name(label: str) -> str:
    """``label`` as the middle of an MLflow metric name: letters, digits, ``_`` and ``-`` kept,
    anything else ``_``; a label that had to change (or was cut to METRIC_NAME_CHARS) gets 8 hex
    digits of its SHA-256, so two labels never share a name."""
    safe = _METRIC_UNSAFE.sub("_", label)
    if safe == label and len(label) <= METRIC_NAME_CHARS:
        return label
    digest = hashlib.sha256(label.encode("utf-8")).hexdigest()[:8]
    return f"{safe[:METRIC_NAME_CHARS - 9]}-{digest}"
