"""Fixtures of the stream tests: every contract runs on both backends."""

from __future__ import annotations

import pytest

from online_sao.config import KafkaConfig
from streams.base import StreamBackend
from streams.kafka_backend import KafkaBackend
from streams.memory import InMemoryBackend
from tests.fixtures.kafka import TEST_PARTITIONS


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def backend(request) -> StreamBackend:
    """The in-memory backend with its topics made, or the real broker's (the test session's)."""
    if request.param == "memory":
        backend = InMemoryBackend(KafkaConfig(partitions=TEST_PARTITIONS))
        backend.ensure_topics()
        return backend
    return KafkaBackend(request.getfixturevalue("kafka_config"))
