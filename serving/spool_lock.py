"""One serving process per spool directory.

The spool (serving/spool.py) keeps its own offsets into files it assumes no one else writes:
two processes on one directory (two replicas given the same ``serving.spool_dir``, or two
``online-sao serve`` on one data directory) read each other's records as their own, send them,
and cut them off when they empty the spool, losing records their clients were told were durable.
``online-sao serve`` therefore holds an exclusive lock on ``spool.lock`` in the directory for as
long as it runs, and a second process is refused at start. The lock is the operating system's
(``flock``): a process that dies releases it, so no stale lock outlives a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from online_sao.config import ConfigError
from online_sao.dir_lock import DirectoryLock

LOCK_FILE = "spool.lock"


class SpoolInUse(ConfigError):
    """Another process holds the spool directory."""


@contextmanager
def exclusive_spool(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s spool lock for the block; :class:`SpoolInUse` when another holder has it."""
    def refused(holder: str) -> SpoolInUse:
        return SpoolInUse(f"serving.spool_dir {directory} is in use by another serving process (pid {holder}): "
                          "give each replica a spool directory of its own")

    with DirectoryLock.acquire(directory, LOCK_FILE, refused):
        yield
