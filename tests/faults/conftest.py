"""Fixtures of the fault suite: ``live_stack`` makes :class:`tests.faults.harness.LiveStack` runs.

Each call of the factory gives a stack (not started) with its own broker and data
directory under the test's tmp_path; every stack made is closed after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.faults.harness import LiveStack


@pytest.fixture
def live_stack(tmp_path, tiny_model_dir, kafka_lib_dir) -> Iterator[Callable[..., LiveStack]]:
    """``live_stack(overrides)`` -> a LiveStack under tmp_path; call ``.start()`` on it."""
    made: list[LiveStack] = []

    def make(overrides: dict[str, Any] | None = None) -> LiveStack:
        stack = LiveStack(tmp_path / f"stack-{len(made)}", tiny_model_dir, kafka_lib_dir, overrides)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()
