"""naming_the_file: an OS error that names no file gets the file it was writing; nothing else changes.
replace_with_text: the new file and its name are on disk when it returns."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError

from online_sao.durable import naming_the_file, replace_with_text


def test_an_os_error_without_a_file_names_the_file_and_keeps_its_errno():
    with pytest.raises(OSError) as caught, naming_the_file("/w/v3.tmp"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, "/w/v3.tmp")
    assert str(caught.value) == "[Errno 28] No space left on device: '/w/v3.tmp'"


def test_an_os_error_that_names_its_file_and_its_subclass_are_left_as_they_are():
    original = PermissionError(errno.EACCES, "Permission denied", "/elsewhere")
    with pytest.raises(PermissionError) as caught, naming_the_file("/w/v3.tmp"):
        raise original
    assert caught.value is original


def test_safetensors_error_with_an_os_error_in_its_text_becomes_that_os_error():
    with pytest.raises(OSError) as caught, naming_the_file("/c/.tmp-1/optim.safetensors"):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (caught.value.errno, caught.value.filename) == (28, "/c/.tmp-1/optim.safetensors")
    assert isinstance(caught.value.__cause__, SafetensorError)


def test_a_safetensors_error_of_its_own_is_left_as_it_is():
    with pytest.raises(SafetensorError, match="invalid header"), naming_the_file("/c/x.safetensors"):
        raise SafetensorError("Error while deserializing header: invalid header")


def test_a_replaced_file_has_its_directory_flushed_after_the_rename(tmp_path, monkeypatch):
    """The rename was never flushed: a power loss could bring back the old spool.acked or spool.window
    (acknowledged records sent again) or lose spool.clock-step, after the spool had gone on."""
    events = []
    fsync, rename = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_rename(source, target):
        events.append(("rename", str(source), str(target)))
        return rename(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_rename)
    replace_with_text(tmp_path / "spool.acked", "8\n")
    tmp, path = str(tmp_path / "spool.acked.tmp"), str(tmp_path / "spool.acked")
    assert events == [("fsync", tmp), ("rename", tmp, path), ("fsync", str(tmp_path))]
    assert Path(path).read_text() == "8\n"
