"""The ledger as segment files: rotation, sealed segments the operator may remove, crash cuts
across a rotation, and checkpoint directories of the layout before segments (one ledger.jsonl)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from streams.base import TopicPartition
from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState, read_ledger, redact_ledger
from trainer.ledger import torn_files


def _save(checkpointer: Checkpointer, step: int, ids: list[str], version: int | None = None) -> None:
    checkpointer.record_trained(step, ids)
    state = LearnerState(step=step, version=step if version is None else version,
                         offsets={TopicPartition("sao.interactions", 0): step}, joiner={"waiting": []})
    checkpointer.save(Checkpoint(state, models={"policy": {"w": torch.full((2,), float(step))}}, optimizers={}))


def _names(checkpointer: Checkpointer) -> list[str]:
    return [p.name for p in checkpointer.ledger.segments()]


def test_the_ledger_rotates_and_sealed_segments_may_be_deleted(tmp_path):
    """The audit's repro: moving the old ledger aside (or keeping its tail) made the learner refuse
    to start. Now whole sealed segments go, and the learner resumes and appends on."""
    checkpointer = Checkpointer(tmp_path, ledger_segment_bytes=40)  # about two steps' lines a segment
    for step in range(1, 7):
        _save(checkpointer, step, [f"id-{step}-a", f"id-{step}-b"])
    assert _names(checkpointer) == ["00000001.jsonl", "00000003.jsonl", "00000005.jsonl"]
    assert [step for step, _ in read_ledger(tmp_path)] == [s for s in range(1, 7) for _ in range(2)]
    sealed = checkpointer.sealed_segments()
    assert [p.name for p in sealed] == ["00000001.jsonl", "00000003.jsonl"]

    archive = tmp_path.parent / "archive"
    archive.mkdir()
    shutil.move(str(sealed[0]), archive)
    sealed[1].unlink()
    again = Checkpointer(tmp_path, ledger_segment_bytes=40)
    assert again.resume().state.step == 6
    _save(again, 7, ["id-7-a"])
    assert read_ledger(tmp_path) == [(5, "id-5-a"), (5, "id-5-b"), (6, "id-6-a"), (6, "id-6-b"), (7, "id-7-a")]
    assert read_ledger(archive / "00000001.jsonl") == [(1, "id-1-a"), (1, "id-1-b"), (2, "id-2-a"), (2, "id-2-b")]


def test_a_segment_started_by_an_uncommitted_checkpoint_is_deleted_on_resume(tmp_path, monkeypatch):
    checkpointer = Checkpointer(tmp_path, ledger_segment_bytes=1)
    _save(checkpointer, 1, ["a"])

    def killed(*args):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr("trainer.checkpoint.os.rename", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(checkpointer, 2, ["b"])
    monkeypatch.undo()
    assert _names(checkpointer) == ["00000001.jsonl", "00000002.jsonl"]

    again = Checkpointer(tmp_path, ledger_segment_bytes=1)
    assert again.resume().state.step == 1
    assert _names(again) == ["00000001.jsonl"] and read_ledger(tmp_path) == [(1, "a")]
    _save(again, 2, ["c"])
    assert read_ledger(tmp_path) == [(1, "a"), (2, "c")]


def _to_old_layout(root, uncommitted: bytes) -> None:
    """What the learner wrote before segments: one ledger.jsonl, checkpoints without index.json and
    without ``ledger_segment`` (their ``ledger_bytes`` is that file's length)."""
    (segment,) = (root / "ledger").iterdir()
    (root / "ledger.jsonl").write_bytes(segment.read_bytes() + uncommitted)
    shutil.rmtree(root / "ledger")
    for path in root.glob("step-*"):
        (path / "index.json").unlink()
        meta = json.loads((path / "meta.json").read_text())
        del meta["state"]["ledger_segment"]
        (path / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_dir_of_the_old_layout_resumes_on_the_first_segment(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=1)
    checkpointer.pinned_versions = {7}
    _save(checkpointer, 1, ["a", "b"], version=7)
    _save(checkpointer, 2, ["c"], version=8)
    _to_old_layout(tmp_path, uncommitted=b'{"step":3,"ids":["lost"]}\n')

    again = Checkpointer(tmp_path, keep=1, ledger_segment_bytes=1)
    again.pinned_versions = {7}
    assert again.resume().state.step == 2
    assert not (tmp_path / "ledger.jsonl").exists() and _names(again) == ["00000000.jsonl"]
    assert read_ledger(tmp_path) == [(1, "a"), (1, "b"), (2, "c")]  # the uncommitted step's line cut
    assert again.checkpoint_of_version(7).state.step == 1  # found without an index.json
    _save(again, 3, ["d"], version=9)
    assert [s for s, _ in again.checkpoints()] == [1, 3]  # version 7's first checkpoint stays pinned
    assert _names(again) == ["00000000.jsonl", "00000003.jsonl"]
    assert [p.name for p in again.sealed_segments()] == ["00000000.jsonl"]
    assert read_ledger(tmp_path) == [(1, "a"), (1, "b"), (2, "c"), (3, "d")]


def test_a_migration_cut_short_after_its_rename_is_finished_on_the_next_start(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    _save(checkpointer, 1, ["a"])
    _to_old_layout(tmp_path, uncommitted=b"")
    (tmp_path / "ledger").mkdir()  # killed between the rename of the new directory and the old name's removal
    shutil.copyfile(tmp_path / "ledger.jsonl", tmp_path / "ledger" / "00000000.jsonl")

    assert Checkpointer(tmp_path).resume().state.step == 1
    assert not (tmp_path / "ledger.jsonl").exists() and read_ledger(tmp_path) == [(1, "a")]


def test_a_ledger_and_a_different_old_ledger_file_are_not_merged(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    _save(checkpointer, 1, ["a"])
    (tmp_path / "ledger.jsonl").write_text('{"step":1,"ids":["other"]}\n')
    with pytest.raises(RuntimeError, match="both exist"):
        Checkpointer(tmp_path).resume()
    assert (tmp_path / "ledger.jsonl").exists()


@pytest.mark.parametrize("left_as", ["link", "copy"])
def test_a_migration_cut_short_is_read_once_and_redacted_in_both_names(tmp_path, left_as):
    """Killed between the rename of the new directory and the old name's removal (Ledger.migrate): the
    old name is the first segment's link (or copy). Read as a file of its own, every id it held was
    listed twice; redacted in one name alone, the learner would refuse to start (the two differing)."""
    checkpointer = Checkpointer(tmp_path)
    _save(checkpointer, 1, ["a", "b"])
    _to_old_layout(tmp_path, uncommitted=b"")
    (tmp_path / "ledger").mkdir()
    place = os.link if left_as == "link" else shutil.copyfile
    place(tmp_path / "ledger.jsonl", tmp_path / "ledger" / "00000000.jsonl")

    assert read_ledger(tmp_path) == [(1, "a"), (1, "b")]
    assert redact_ledger(tmp_path, {"b"}) == 1  # counted once, though written in both names
    assert (tmp_path / "ledger.jsonl").read_bytes() == (tmp_path / "ledger" / "00000000.jsonl").read_bytes()
    assert Checkpointer(tmp_path).resume().state.step == 1  # the next start finishes the migration
    assert not (tmp_path / "ledger.jsonl").exists() and read_ledger(tmp_path) == [(1, "a"), (1, "-")]


TORN = b'{"step":3,"ids":["c","d'
"""What an append the learner was making when it stopped (a full disk, a kill) may leave: no newline."""


def test_a_torn_last_line_is_not_read_and_redaction_leaves_it_to_the_next_start(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    _save(checkpointer, 1, ["a", "b"])
    _save(checkpointer, 2, ["c"])
    (segment,) = checkpointer.ledger.segments()
    committed = segment.read_bytes()
    with open(segment, "ab") as fh:
        fh.write(TORN)

    assert read_ledger(tmp_path) == [(1, "a"), (1, "b"), (2, "c")]  # raised a bare JSONDecodeError
    assert torn_files(tmp_path) == [segment]
    assert redact_ledger(tmp_path, {"c"}) == 1
    assert segment.read_bytes() == committed.replace(b'"c"', b'"-"') + TORN  # the torn line as it was
    assert Checkpointer(tmp_path).resume().state.step == 2  # which the next start cuts
    assert segment.read_bytes() == committed.replace(b'"c"', b'"-"') and torn_files(tmp_path) == []


def test_a_sealed_segments_last_line_without_its_newline_is_read_and_redacted(tmp_path):
    """A sealed segment edited by hand may lose its final newline: its last (whole) line was taken for a
    torn one, left out of the ledger and of an erasure, which then said the id was never trained on."""
    checkpointer = Checkpointer(tmp_path, ledger_segment_bytes=1)
    for step, ids in ((1, ["a"]), (2, ["b", "c"]), (3, ["d"])):
        _save(checkpointer, step, ids)
    sealed = checkpointer.ledger.segments()[1]
    sealed.write_bytes(sealed.read_bytes().rstrip(b"\n"))

    assert read_ledger(tmp_path) == [(1, "a"), (2, "b"), (2, "c"), (3, "d")]
    assert torn_files(tmp_path) == []
    assert redact_ledger(tmp_path, {"c"}) == 1
    assert sealed.read_bytes() == b'{"step":2,"ids":["b","-"]}'


@pytest.mark.parametrize("given", ["ledger", "ledger.jsonl", "ledger/00000000.jsonl"])
def test_a_migration_cut_short_is_redacted_in_both_names_whichever_ledger_path_is_given(tmp_path, given):
    checkpointer = Checkpointer(tmp_path)
    _save(checkpointer, 1, ["a", "b"])
    _to_old_layout(tmp_path, uncommitted=b"")
    (tmp_path / "ledger").mkdir()
    os.link(tmp_path / "ledger.jsonl", tmp_path / "ledger" / "00000000.jsonl")

    assert redact_ledger(tmp_path / given, {"b"}) == 1
    assert (tmp_path / "ledger.jsonl").read_bytes() == (tmp_path / "ledger" / "00000000.jsonl").read_bytes()
    assert Checkpointer(tmp_path).resume().state.step == 1  # refused: "both exist"


def test_the_current_segments_last_line_without_its_newline_stays_torn(tmp_path):
    """An append cut just before its newline: no checkpoint covers it and the next start cuts it."""
    checkpointer = Checkpointer(tmp_path)
    _save(checkpointer, 1, ["a"])
    (segment,) = checkpointer.ledger.segments()
    with open(segment, "ab") as fh:
        fh.write(b'{"step":2,"ids":["b"]}')
    assert read_ledger(tmp_path) == [(1, "a")] and torn_files(tmp_path) == [segment]
