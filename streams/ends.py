"""Where each partition of some topics begins and ends, kept fresh by a thread of its own.

A reader that reads nothing for a while (the learner's feed under backpressure, its partitions
paused, or during a step) stops hearing where its partitions end, just when it is behind.
:class:`EndWatcher` asks the broker every few seconds
with a consumer of its own (no group: it reads no records and commits nothing), so the reader can
count what it has not read at any moment without waiting on the broker itself: while the broker
is away, the ends stay as last read.
"""

from __future__ import annotations

import logging
import threading

from streams.base import Consumer, StreamBackend, StreamUnavailable, TopicPartition

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long :meth:`EndWatcher.close` waits for the thread; a request to an unreachable broker may
hold it longer (kafka-python's request timeout), and the daemon thread then ends on its own."""


class EndWatcher:
    """Each partition's end offset (and oldest kept offset) on ``topics``, read every ``every_s`` seconds."""

    def __init__(self, backend: StreamBackend, topics: list[str], every_s: float) -> None:
        self._backend = backend
        self._topics = topics
        self._every_s = every_s
        self._ends: dict[TopicPartition, int] = {}
        self._begins: dict[TopicPartition, int] = {}
        self._closed = threading.Event()
        self._read_once = threading.Event()
        self._thread = threading.Thread(target=self._run, name="end-watcher", daemon=True)
        self._thread.start()

    def ends(self) -> dict[TopicPartition, int]:
        """The ends as last read (empty before the first read)."""
        return self._ends

    def begins(self) -> dict[TopicPartition, int]:
        """Each partition's oldest kept offset as last read (empty before the first read)."""
        return self._begins

    def wait_for_first_read(self, timeout_s: float) -> bool:
        """Whether the ends were read at least once within ``timeout_s``."""
        return self._read_once.wait(timeout_s)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=CLOSE_WAIT_S)

    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            while not self._closed.is_set():
                try:
                    consumer = consumer or self._backend.consumer(self._topics, group_id=None, start="latest")
                    self._begins = consumer.beginning_offsets()  # one assignment replaces the dict whole
                    self._ends = consumer.end_offsets()
                    self._read_once.set()
                except StreamUnavailable as exc:  # the broker is away: keep the last ends, ask again
                    log.debug("end offsets of %s not read: %s", self._topics, exc)
                except Exception:  # noqa: BLE001 - any other failure ended the thread, and the ends went stale for good
                    log.exception("end offsets of %s not read: keeping the last ones, asking again with a new "
                                  "consumer", self._topics)
                    if consumer is not None:
                        consumer.close()
                    consumer = None
                self._closed.wait(self._every_s)
        finally:
            if consumer is not None:
                consumer.close()
