"""The in-memory broker's polls: a partition that always holds a full poll's worth of records
waiting does not keep the others from being read."""

from __future__ import annotations

from streams.memory import InMemoryBackend
from streams.memory_log import partition_for_key


def key_on(partition: int, partitions: int) -> bytes:
    return next(k for k in (str(i).encode() for i in range(1000)) if partition_for_key(k, partitions) == partition)


def test_a_busy_partition_does_not_starve_the_others():
    backend = InMemoryBackend()
    backend.create_topic("t", 3)
    producer = backend.producer()
    for i in range(20):  # partition 0 holds more than any poll below takes
        producer.send("t", f"busy-{i}".encode(), key=key_on(0, 3))
    for p in (1, 2):
        producer.send("t", f"quiet-{p}".encode(), key=key_on(p, 3))
    consumer = backend.consumer(["t"], group_id="g", start="earliest")
    seen: set[int] = set()
    for _ in range(3):
        seen |= {m.partition for m in consumer.poll(timeout_s=0.0, max_records=4)}
    assert seen == {0, 1, 2}
