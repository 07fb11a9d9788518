"""A partition's records as the in-memory backend (:mod:`streams.memory`) keeps them, and where a key goes."""

from __future__ import annotations

from kafka.partitioner.default import murmur2

from streams.base import StreamMessage


def partition_for_key(key: bytes, partitions: int) -> int:
    """Kafka's default partition of a key: positive murmur2 modulo the partition count."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class PartitionLog:
    """A partition's records from offset ``start`` on. Offsets are absolute: deleting records from the
    front moves ``start``, never renumbers what stays (Kafka's log start offset)."""

    __slots__ = ("start", "records")

    def __init__(self) -> None:
        self.start = 0
        self.records: list[StreamMessage] = []

    @property
    def end(self) -> int:
        """The offset the next record gets."""
        return self.start + len(self.records)

    def read(self, offset: int, limit: int) -> list[StreamMessage]:
        """Up to ``limit`` records from ``offset`` on (``offset`` at or above ``start``)."""
        first = offset - self.start
        return self.records[first:first + limit]

    def delete_below(self, offset: int) -> None:
        n = min(offset - self.start, len(self.records))
        if n > 0:
            del self.records[:n]
            self.start += n
