"""Durability on a POSIX file system: what makes a rename or a new file survive a crash."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError


PRIVATE_FILE_MODE = 0o600
"""The mode of files of users' data (serving's spool of prompts and answers, the learner's ledger of
the interaction ids it trained on, a checkpoint's id memory): their writer's user alone may read them,
whatever the umask (022 made them world-readable)."""


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: a file it creates is :data:`PRIVATE_FILE_MODE`; an existing
    file keeps its mode."""
    return os.open(path, flags, PRIVATE_FILE_MODE)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_with_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves the old file or the new one, whole: written to
    a temporary file beside it (``<name>.tmp``, one of its own for every file), flushed to disk, renamed
    over it, and the directory flushed: without that a power loss could undo the rename after the
    caller went on (the spool's watermark or read back window back at an older value: acknowledged
    records sent again). OSError propagates, also when only the directory's flush failed (the new file
    may then be in place or not)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""OS errors of a write that found no room: a full disk, a quota. An operator fixes them by making
room; a restart then goes on (the learner's and serving's errors name the file)."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL


_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How safetensors' errors carry the OS error under them (Rust's ``std::io::Error``)."""


@contextmanager
def naming_the_file(path: Path | str) -> Iterator[None]:
    """An OS error raised inside names ``path``. A write or fsync that fails (a full disk) raises one
    that names no file ("[Errno 28] No space left on device"), and safetensors raises its own error
    with the OS error in its text ("Error while serializing: I/O error: No space left on device (os
    error 28)"): the operator learnt neither which disk was full nor which file was being written.
    Either becomes an ``OSError`` with the same errno naming ``path``; any other error is left as it is."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None or exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except SafetensorError as exc:
        found = _OS_ERROR.search(str(exc))
        if found is None:  # not the disk's: serialising itself failed
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
