"""Per-segment books with bounded cardinality (docs/DEPLOY.md, "Segments").

A segment is a group of requests an operator wants to see apart: by default the OpenAI
``user`` of a request, or a metadata field named in ``serving.segment_field``; it is logged
on the interaction record (``Interaction.segment``). Users are many, labels of a metrics
system must be few: :class:`SegmentCounter` keeps the ``top_n`` segments by traffic and
folds every other one into the label :data:`OTHER`, so at most ``top_n + 1`` labels appear
at a time; records without a segment count as the segment :data:`NO_SEGMENT`.

Counting every distinct key exactly would grow without bound, so the counter is the
space-saving sketch: it holds ``TRACKED_PER_LABEL * top_n`` keys; a new key replaces the
least counted one and inherits its count (an overestimate by at most that count). Every
key whose share of the traffic exceeds ``1 / (TRACKED_PER_LABEL * top_n)`` is held, and the
held counts sum to the total, so :data:`OTHER` = total - the top ``top_n`` counts.

:class:`SegmentRewards` adds each segment's recent rewards and the named scores behind them
(``Reward.scores``, a judge's quality say: the learner's side), for MLflow under slot keys.

Why slots. A metric key per label (``segment.<label>.reward``) made every label that ever
entered the top N a key of the run for good: with 5000 equally active users the top N churns,
and an audit counted 5,794 keys after 1500 steps, each a row of MLflow's latest-metrics table
that every ``get_run`` reads. So the keys are ``segment.slot<k>.*`` (k = 1..top_n) and
``segment.other.*``: at most ``(top_n + 1) * (2 + SCORE_NAMES_TRACKED)`` keys, across restarts
too, whatever the users send (:class:`SegmentSlots`). A slot is not a rank: a label keeps its
slot while it stays in the top N, and an entrant takes the slot a leaver freed, so a steady
segment is one series. Which label a slot shows is in two run tags per slot, overwritten when
it changes (so bounded as well): ``segment.slot<k>``, the label now, and
``segment.slot<k>.history``, ``<step> <label>`` lines (the newest SLOT_HISTORY_CHARS
characters): a figure logged at step T belongs to the label of the newest line at or before T.
Not chosen: keys named after labels that held their place for some windows, capped: the cap
holds for one learner lifetime (the books are not checkpointed), each restart could add as many
keys again, and labels beyond the cap would need slots anyway; the slot-to-label map as an
artifact per log window: one file per window, as unbounded as the keys were.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
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
"""Distinct score names the books keep (the first seen, whichever segment carried them): each is a
metric per slot, so a source that sent a new name with every reward must not grow the metrics
without bound."""
SLOT_HISTORY_CHARS = 4000
"""Longest ``segment.slot<k>.history`` tag (MLflow takes 8000 characters): the oldest lines go
first. A line is at most a step and a SEGMENT_MAX_CHARS label."""


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


class SegmentSlots:
    """The metric slot of each top-N label and each slot's labels over time (module docstring,
    "Why slots"); ``resumed`` is the run's tags when the learner reopens it: the histories go on."""

    def __init__(self, top_n: int, resumed: Mapping[str, str] | None = None) -> None:
        self.labels: list[str | None] = []
        """Slot k's label at index k - 1 (None: its label left the top N and nobody took the slot);
        as long as the most slots ever used, at most ``top_n``."""
        resumed = resumed or {}
        self._history = [resumed.get(slot_tag(k, "history"), "").splitlines() for k in range(1, top_n + 1)]
        """Each slot's history lines, oldest first."""

    def seat(self, top: Iterable[str]) -> None:
        """Labels that left ``top`` free their slots; labels new to it take the lowest free ones. A
        key spelled :data:`OTHER` is the other bucket, never a slot."""
        top = [label for label in top if label != OTHER]
        self.labels = [label if label in top else None for label in self.labels]
        for label in top:
            if label not in self.labels:
                if None in self.labels:
                    self.labels[self.labels.index(None)] = label
                else:
                    self.labels.append(label)

    def tags(self, step: int) -> dict[str, str]:
        """The run tags of every slot used: ``segment.slot<k>``, the label now ('' when empty), and
        ``segment.slot<k>.history``, which gets the line ``<step> <label>`` (``<step>`` alone: emptied)
        when the slot's label is not the one its last line names."""
        out: dict[str, str] = {}
        for k, label in enumerate(self.labels, 1):
            lines = self._history[k - 1]
            named = (lines[-1].partition(" ")[2] or None) if lines else None
            if named != label:
                lines.append(str(step) if label is None else f"{step} {label}")
                while len(lines) > 1 and sum(len(line) + 1 for line in lines) > SLOT_HISTORY_CHARS:
                    del lines[0]
            out[slot_tag(k)] = label or ""
            out[slot_tag(k, "history")] = "\n".join(lines)
        return out


def slot_tag(k: int, part: str | None = None) -> str:
    """The key of slot ``k`` (from 1): ``segment.slot<k>``, or ``segment.slot<k>.<part>``."""
    return f"segment.slot{k}" if part is None else f"segment.slot{k}.{part}"


class SegmentRewards:
    """Rewards per segment: traffic decides the labels (:class:`SegmentCounter`) and their slots
    (:class:`SegmentSlots`); each label keeps its newest ``window`` rewards. A reward goes to the
    label its segment has when it arrives; a label that leaves the top N loses its rewards (they
    were counted under it)."""

    def __init__(self, top_n: int, window: int, resumed: Mapping[str, str] | None = None) -> None:
        self.counter = SegmentCounter(top_n)
        self.slots = SegmentSlots(top_n, resumed)
        self.window = window
        self.rewards: dict[str, deque[float]] = {}
        self.scores: dict[str, dict[str, deque[float]]] = {}
        """label -> score name -> the newest ``window`` values."""
        self.score_names: list[str] = []
        """The first SCORE_NAMES_TRACKED score names seen; the others are not kept."""

    def observe(self, segment: str | None, reward: float, scores: Mapping[str, float] | None = None) -> None:
        """One reward of ``segment`` and the named scores it carried."""
        self.counter.observe(segment)
        top = self.counter.top()
        self.slots.seat(top)
        key = NO_SEGMENT if segment is None else segment
        label = key if key in top else OTHER
        self.rewards.setdefault(label, deque(maxlen=self.window)).append(float(reward))
        label_scores = self.scores.setdefault(label, {})
        for name, value in (scores or {}).items():
            if name not in self.score_names and len(self.score_names) < SCORE_NAMES_TRACKED:
                self.score_names.append(name)
            if name in self.score_names:
                label_scores.setdefault(name, deque(maxlen=self.window)).append(float(value))
        kept = set(top) | {OTHER}
        for gone in [name for name in self.rewards if name not in kept]:
            del self.rewards[gone]
            self.scores.pop(gone, None)

    def stats(self) -> dict[str, SegmentStat]:
        """Each label's :class:`SegmentStat` (labels with rewards in the window only)."""
        return {label: SegmentStat(sum(values) / len(values) if values else math.nan, len(values),
                                   {name: sum(v) / len(v) for name, v in sorted(self.scores.get(label, {}).items())})
                for label, values in self.rewards.items()}

    def metrics(self) -> dict[str, float]:
        """``<slot>.reward``, ``<slot>.count`` and ``<slot>.score_<name>`` (every kept score name)
        for each slot used (``segment.slot<k>``) and, once it has rewards, ``segment.other``. What
        a slot's label has no reward for now is NaN (count 0), so the slot's newest figures are
        never those of the label before."""
        stats = self.stats()
        empty = SegmentStat(math.nan, 0)
        shown = [(slot_tag(k), stats.get(label, empty) if label else empty)
                 for k, label in enumerate(self.slots.labels, 1)]
        shown += [("segment.other", stats[OTHER])] if OTHER in stats else []
        out: dict[str, float] = {}
        for prefix, stat in shown:
            out[f"{prefix}.reward"] = stat.reward
            out[f"{prefix}.count"] = float(stat.count)
            out.update({f"{prefix}.score_{name}": stat.scores.get(name, math.nan) for name in self.score_names})
        return out
