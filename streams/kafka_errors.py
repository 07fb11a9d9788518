"""kafka-python's errors as the stream seam's: which mean "the cluster cannot be reached now"
(:class:`~streams.base.StreamUnavailable`) and which mean "this member is not in its group now"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import kafka.errors as kerr

from streams.base import StreamUnavailable


MEMBERSHIP_ERRORS = (kerr.CommitFailedError, kerr.RebalanceInProgressError, kerr.UnknownMemberIdError,
                     kerr.IllegalGenerationError)
"""kafka-python errors of a commit the group refused because this member is not in it (now): it rejoins
at its next poll (kafka-python turns the last two into CommitFailedError; all four are named to be sure)."""

UNAVAILABLE_ERRORS = (kerr.KafkaTimeoutError, kerr.KafkaConnectionError, kerr.NodeNotReadyError,
                      kerr.RequestTimedOutError, kerr.BrokerNotAvailableError, kerr.MetadataEmptyBrokerList)
"""kafka-python errors that mean "the cluster cannot be reached now" rather than "this
request is wrong" (kafka-python 3 reports a failed bootstrap as KafkaTimeoutError)."""


def unavailable(exc: Exception) -> bool:
    return isinstance(exc, UNAVAILABLE_ERRORS)


@contextmanager
def as_stream_errors(action: str, bootstrap: str) -> Iterator[None]:
    try:
        yield
    except kerr.KafkaError as exc:
        if unavailable(exc):
            raise StreamUnavailable(f"{action}: Kafka at {bootstrap} not reachable: {exc}") from exc
        raise
