"""One process per directory (online_sao/dir_lock.py)."""

from __future__ import annotations

import errno
import os

import pytest

from online_sao.dir_lock import DirectoryLock


class InUse(Exception):
    pass


def test_a_second_holder_is_refused_with_the_first_ones_pid_until_it_lets_go(tmp_path):
    with DirectoryLock.acquire(tmp_path / "d", "x.lock", InUse):
        with pytest.raises(InUse, match=str(os.getpid())):
            DirectoryLock.acquire(tmp_path / "d", "x.lock", InUse)
    DirectoryLock.acquire(tmp_path / "d", "x.lock", InUse).release()


def test_a_lock_whose_pid_could_not_be_written_is_not_left_held(tmp_path, monkeypatch):
    """A full disk at the pid's write kept the lock with its file open: a learner started again in the
    same process was refused, "in use by another learner"."""
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        DirectoryLock.acquire(tmp_path, "x.lock", InUse)
    monkeypatch.undo()
    DirectoryLock.acquire(tmp_path, "x.lock", InUse).release()
