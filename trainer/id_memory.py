"""The learner's memory of finished interaction ids, finite and still exactly-once.

Every interaction the join is done with (trained, dropped, stale, evicted, or
trained as a turn of a continuation) is remembered by id with its *anchor*: the
time the interaction was created, ``min(created_at, record timestamp)`` — the same
for every copy of one record, however late a copy is replayed (a record whose
``created_at`` lies in the future is anchored at its timestamp instead, so a wrong
clock cannot pin it in memory).

The memory is finite and forgets by anchor, oldest first: every id whose anchor
is at or below :attr:`IdMemory.floor` is forgotten, and the floor only rises —
to ``watermark - horizon_s`` as the record clock advances, and to the anchor of
the id given up when more than ``capacity`` ids are held. An interaction that
arrives with an anchor at or below the floor is therefore one the memory could
no longer tell apart from a copy of a finished one: the join refuses it
(counted), so no replay, however long after the first copy, trains an
interaction twice. The price is that a record first delivered more than
``horizon_s`` after its creation is not trained.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from array import array
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)  # slots: up to trainer.join_max_pending (100,000) are held, a third less memory each
class Remembered:
    """What the join knows about a finished id."""

    anchor: float
    trained: bool
    """Its sampled tokens were trained (as its own rollout or as turns of a continuation)."""
    seen: bool
    """Its own record was read (False: known only as a turn of a continuation that was trained)."""


@dataclass(frozen=True)
class MemorySnapshot:
    """The memory as it was when :meth:`IdMemory.snapshot` was taken; the memory goes on changing
    without touching it (its :class:`Remembered` values are immutable and shared)."""

    floor: float
    ids: dict[str, Remembered]


def anchor_time(created_at: float, timestamp: float) -> float:
    """The anchor of a record: its creation time, at most its record timestamp (module docstring)."""
    return min(created_at, timestamp)


class IdMemory:
    """Finished ids by anchor time; see the module docstring."""

    def __init__(self, horizon_s: float, capacity: int) -> None:
        self.horizon_s = horizon_s
        self.capacity = capacity
        self.floor = -math.inf
        self._ids: dict[str, Remembered] = {}
        self._by_anchor: list[tuple[float, str]] = []  # heap (lazy: stale pairs are skipped)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, interaction_id: str) -> bool:
        return interaction_id in self._ids

    def get(self, interaction_id: str) -> Remembered | None:
        return self._ids.get(interaction_id)

    def forgotten(self, anchor: float) -> bool:
        """Whether an id with this anchor would no longer be remembered (refuse it)."""
        return anchor <= self.floor

    def advance(self, watermark: float) -> None:
        """The record clock reached ``watermark``: forget what is older than the horizon."""
        self._raise_floor(watermark - self.horizon_s)

    def remember(self, interaction_id: str, anchor: float, trained: bool, seen: bool) -> None:
        """Note a finished id (an id already held keeps its anchor; flags only turn on)."""
        held = self._ids.get(interaction_id)
        if held is not None:
            if (trained and not held.trained) or (seen and not held.seen):
                self._ids[interaction_id] = Remembered(held.anchor, held.trained or trained, held.seen or seen)
            return
        if self.forgotten(anchor):
            return  # its copies are refused by the floor anyway
        self._ids[interaction_id] = Remembered(anchor, trained, seen)
        heapq.heappush(self._by_anchor, (anchor, interaction_id))
        while len(self._ids) > self.capacity:
            self._raise_floor(self._oldest_anchor())

    def _oldest_anchor(self) -> float:
        while True:
            anchor, iid = self._by_anchor[0]
            held = self._ids.get(iid)
            if held is not None and held.anchor == anchor:
                return anchor
            heapq.heappop(self._by_anchor)

    def _raise_floor(self, floor: float) -> None:
        if floor <= self.floor:
            return
        self.floor = floor
        while self._by_anchor and self._by_anchor[0][0] <= floor:
            anchor, iid = heapq.heappop(self._by_anchor)
            held = self._ids.get(iid)
            if held is not None and held.anchor == anchor:
                del self._ids[iid]

    def snapshot(self) -> MemorySnapshot:
        """A copy that later changes of the memory leave alone: one dict copy (a few milliseconds at
        100,000 ids), cheap enough for the learner's thread; :func:`encode_snapshot` runs elsewhere."""
        return MemorySnapshot(self.floor, dict(self._ids))

    def restore(self, snapshot: MemorySnapshot) -> None:
        """Become what ``snapshot`` holds (its dict is copied, so the snapshot stays as it is)."""
        self.floor = snapshot.floor
        self._ids = dict(snapshot.ids)
        self._by_anchor = [(r.anchor, iid) for iid, r in self._ids.items()]
        heapq.heapify(self._by_anchor)

    def state_dict(self) -> dict[str, Any]:
        """The memory as JSON-serialisable data (checkpoints write :func:`encode_snapshot` instead)."""
        return {"floor": None if self.floor == -math.inf else self.floor,
                "ids": [[iid, r.anchor, r.trained, r.seen] for iid, r in self._ids.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ids = {iid: Remembered(anchor, trained, seen) for iid, anchor, trained, seen in state["ids"]}
        self.restore(MemorySnapshot(-math.inf if state["floor"] is None else state["floor"], ids))


SNAPSHOT_FORMAT = 1
"""Version of :func:`encode_snapshot`'s layout, in its header line."""
_TRAINED, _SEEN = 1, 2


def encode_snapshot(snapshot: MemorySnapshot) -> bytes:
    """``snapshot`` as compact bytes: a JSON header line (format, count, floor), then every id's
    anchor (float64), flags (one byte), UTF-8 length (uint16: an id has at most 256 characters)
    and the ids' UTF-8 bytes, each array little-endian. 100,000 of the ids serving mints (113
    characters, serving/ids.py) take 12.4 MB (15.1 MB as JSON lists) and encode in tens of
    milliseconds, no JSON parser involved."""
    encoded = [iid.encode() for iid in snapshot.ids]
    values = snapshot.ids.values()
    anchors = array("d", [r.anchor for r in values])
    lengths = array("H", map(len, encoded))
    flags = bytes(_TRAINED * r.trained + _SEEN * r.seen for r in values)
    header = {"format": SNAPSHOT_FORMAT, "count": len(encoded),
              "floor": None if snapshot.floor == -math.inf else snapshot.floor}
    return b"".join([json.dumps(header).encode(), b"\n", _little(anchors), flags, _little(lengths), *encoded])


def decode_snapshot(data: bytes) -> MemorySnapshot:
    """Inverse of :func:`encode_snapshot`."""
    line_end = data.index(b"\n")
    header = json.loads(data[:line_end])
    if header["format"] != SNAPSHOT_FORMAT:
        raise ValueError(f"id memory format {header['format']} is not {SNAPSHOT_FORMAT}")
    count, at = header["count"], line_end + 1
    anchors, at = _read_array("d", data, at, count)
    flags, at = data[at:at + count], at + count
    lengths, at = _read_array("H", data, at, count)
    ids: dict[str, Remembered] = {}
    for anchor, flag, length in zip(anchors, flags, lengths):
        ids[data[at:at + length].decode()] = Remembered(anchor, bool(flag & _TRAINED), bool(flag & _SEEN))
        at += length
    if at != len(data):
        raise ValueError(f"id memory holds {len(data) - at} bytes past its {count} ids")
    return MemorySnapshot(-math.inf if header["floor"] is None else header["floor"], ids)


def _little(values: array) -> bytes:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _read_array(typecode: str, data: bytes, at: int, count: int) -> tuple[array, int]:
    values = array(typecode)
    end = at + count * values.itemsize
    values.frombytes(data[at:end])
    if sys.byteorder == "big":
        values.byteswap()
    return values, end
