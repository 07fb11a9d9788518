"""Fixtures shared by every test package.

Kafka fixtures (a real broker started once per session) live in
tests/fixtures/kafka.py; model fixtures in tests/fixtures/models.py; the umask fixture in
tests/fixtures/files.py.
"""

from __future__ import annotations

import pytest
import torch

from apps import stack

pytest_plugins = ["tests.fixtures.files", "tests.fixtures.kafka", "tests.fixtures.models"]

# Two CPU cores are shared by the broker, servers, subprocesses and the test process:
# one intra-op thread avoids OpenMP workers spinning for a core another process holds.
torch.set_num_threads(1)


def _free_port() -> int:
    return stack.free_port()


@pytest.fixture
def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    return _free_port()


@pytest.fixture
def free_port_factory():
    """Call it for as many distinct free ports as a test needs."""
    return _free_port
