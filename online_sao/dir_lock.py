"""One process per directory: an exclusive ``flock`` on a lock file inside it, held while the process
works there. The operating system releases it when the process dies, so no stale lock outlives a
crash. Serving's spool (serving/spool_lock.py) and the learner's checkpoint directory
(trainer/startup.py) use it: two writers there each took the other's files for their own."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

HOLDER_BYTES = 64
"""How much of the lock file names the holder (its pid and a newline)."""


class DirectoryLock:
    """An exclusive lock on ``directory / name``, held from :meth:`acquire` until :meth:`release`."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, directory: Path, name: str, refused: Callable[[str], Exception]) -> "DirectoryLock":
        """Take the lock, or raise ``refused(holder)`` (``holder``: the pid the lock file names, or
        "unknown") when another process holds it."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, HOLDER_BYTES, 0).decode(errors="replace").strip() or "unknown"
                raise refused(holder) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:  # refused, or the pid could not be written (a full disk): held by no one
            os.close(fd)
            raise
        return cls(fd, path)

    def release(self) -> None:
        """Let the lock go (closing the file releases it); a second call does nothing."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
