"""The learner's files of user data (the ledger of interaction ids trained on, a checkpoint's id memory and
its meta.json, which holds the join's waiting interactions) are readable by its own user alone, whatever the
umask; the weights keep the mode they had."""

from __future__ import annotations

import torch

from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState
from trainer.id_memory import IdMemory
from trainer.ledger import redact_ledger
from tests.fixtures.files import file_mode


def _save(checkpointer: Checkpointer, step: int, ids: list[str]):
    memory = IdMemory(horizon_s=100.0, capacity=10)
    for k, interaction_id in enumerate(ids):
        memory.remember(interaction_id, float(k), trained=True, seen=True)
    checkpointer.record_trained(step, ids)
    state = LearnerState(step=step, version=step, offsets={}, joiner={"waiting": "my secret question"})
    return checkpointer.save(Checkpoint(state, {"policy": {"w": torch.zeros(1)}}, {}, id_memory=memory.snapshot()))


def test_the_ledger_and_the_id_memory_are_readable_by_their_owner_alone(tmp_path, umask_022):
    path = _save(Checkpointer(tmp_path), 1, ["sao-a", "sao-b"])
    segments = list((tmp_path / "ledger").glob("*.jsonl"))
    assert segments and [file_mode(s) for s in segments] == [0o600] * len(segments)
    assert file_mode(path / "id_memory.bin") == 0o600


def test_every_file_of_a_checkpoint_is_readable_by_its_owner_alone(tmp_path, umask_022):
    path = _save(Checkpointer(tmp_path), 1, ["sao-a"])
    assert "my secret question" in (path / "meta.json").read_text()
    assert {p.name: file_mode(p) for p in path.iterdir()} == {p.name: 0o600 for p in path.iterdir()}


def test_a_redacted_ledger_segment_stays_readable_by_its_owner_alone(tmp_path, umask_022):
    _save(Checkpointer(tmp_path), 1, ["sao-a", "sao-b"])
    segment = next((tmp_path / "ledger").glob("*.jsonl"))
    assert redact_ledger(segment, {"sao-a"}) == 1  # rewritten through a scratch file
    assert file_mode(segment) == 0o600
