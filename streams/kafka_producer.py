"""The stream seam's producer on kafka-python (built by :meth:`streams.kafka_backend.KafkaBackend.producer`)."""

from __future__ import annotations

import logging
import threading

import kafka.errors as kerr
from kafka import KafkaProducer

from streams.base import DeliveryReport, Producer, StreamUnavailable
from streams.kafka_errors import as_stream_errors, unavailable

log = logging.getLogger(__name__)

FORCE_CLOSE_JOIN_S = 5.0
"""How long a producer's close waits for its network thread to stop once told to drop what it holds (it
stops within one network poll; bounded so a close never hangs)."""


class KafkaStreamProducer(Producer):
    def __init__(self, producer: KafkaProducer, bootstrap: str, close_timeout_s: float) -> None:
        self._producer = producer
        self._bootstrap = bootstrap
        self._close_timeout_s = close_timeout_s
        self._failures: list[Exception] = []
        self._unsettled = 0
        """Records queued and neither acknowledged nor failed yet: what a forced close drops."""
        self._failures_lock = threading.Lock()  # callbacks run on kafka-python's I/O thread

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        with as_stream_errors(f"sending to {topic}", self._bootstrap):
            future = self._producer.send(topic, value=value, key=key)
        with self._failures_lock:
            self._unsettled += 1
        future.add_both(self._settled)
        future.add_errback(self._record_failure)
        if on_delivery is not None:
            future.add_callback(lambda _metadata: on_delivery(None))
            future.add_errback(on_delivery)

    def _settled(self, _outcome: object) -> None:
        with self._failures_lock:
            self._unsettled -= 1

    def _record_failure(self, exc: Exception) -> None:
        with self._failures_lock:
            self._failures.append(exc)

    def flush(self, timeout_s: float | None = None) -> None:
        """Raises StreamUnavailable when the cluster did not take every record in time."""
        with as_stream_errors("flushing the producer", self._bootstrap):
            self._producer.flush(timeout=timeout_s)
        with self._failures_lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        first = failures[0]
        summary = f"{len(failures)} record(s) were not acknowledged; first error: {first}"
        if all(isinstance(f, kerr.KafkaError) and (f.retriable or unavailable(f)) for f in failures):
            raise StreamUnavailable(summary) from first
        raise RuntimeError(summary) from first

    def close(self) -> None:
        """Sends what is queued, waiting about client_timeout_s; records still unsent then are dropped
        (their delivery reports say so) and counted in the log. Never raises a Kafka error: a service
        stopping during an outage must stop, not fail here.

        kafka-python's close flushes first, with the same timeout, and a flush that times out raises
        before the network thread is told to stop (even with timeout 0): the producer stayed open, its
        thread running, and its KafkaTimeoutError escaped. Its thread is then stopped here."""
        try:
            self._producer.close(timeout=self._close_timeout_s)
            return
        except kerr.KafkaError as exc:
            failure = exc
        with self._failures_lock:
            unsent = self._unsettled
        log.warning("closing the producer (Kafka at %s): %d record(s) not acknowledged within %.0f s are "
                    "dropped (%s)", self._bootstrap, unsent, self._close_timeout_s, failure)
        self._force_close()

    def abandon(self) -> None:
        """Stop at once, dropping what is queued (logged with its count). Left unclosed instead (serving,
        its records in the spool), kafka-python's own exit hook closed it and printed an "Exception
        ignored in atexit" traceback for the flush that timed out."""
        with self._failures_lock:
            unsent = self._unsettled
        if unsent:
            log.info("closing the producer (Kafka at %s) without waiting: %d record(s) not acknowledged are "
                     "dropped here", self._bootstrap, unsent)
        self._force_close()

    def _force_close(self) -> None:
        """Stop the network thread without sending (it fails the batches it holds, waking their
        futures), then let kafka-python's close finish, which now has nothing to wait for."""
        sender = self._producer._sender  # no public way: close() raises before reaching it
        sender.force_close()
        sender.join(FORCE_CLOSE_JOIN_S)
        try:
            self._producer.close(timeout=0)
        except kerr.KafkaError as exc:  # its thread did not stop in time; nothing more to do
            log.warning("the producer's network thread (Kafka at %s) did not stop within %.0f s: %s",
                        self._bootstrap, FORCE_CLOSE_JOIN_S, exc)
