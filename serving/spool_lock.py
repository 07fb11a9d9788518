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

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from online_sao.config import ConfigError

LOCK_FILE = "spool.lock"


class SpoolInUse(ConfigError):
    """Another process holds the spool directory."""


@contextmanager
def exclusive_spool(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s spool lock for the block; :class:`SpoolInUse` when another holder has it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise SpoolInUse(f"serving.spool_dir {directory} is in use by another serving process (pid {holder}): "
                             "give each replica a spool directory of its own") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
