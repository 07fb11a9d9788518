"""The join's id memory in a checkpoint: a snapshot on the learner's thread, its own compact file
written by the checkpoint writer, meta.json without it, and retention that reads no meta.json."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from online_sao.algorithm import Algorithm
from online_sao.algorithms import Optimizers
from online_sao.config import RewardConfig
from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState
from trainer.distributed import DistContext
from trainer.id_memory import IdMemory, MemorySnapshot, Remembered, decode_snapshot, encode_snapshot
from trainer.join import RewardJoiner
from trainer.state import Progress, Trainables, gather_training_state, restore_training_state

ONE_PROCESS = DistContext(0, 1, torch.device("cpu"))


class Idle(Algorithm):
    def step(self, batch):
        raise AssertionError("not trained here")


def _trainables() -> Trainables:
    torch.manual_seed(0)
    policy = nn.Linear(2, 2)
    return Trainables(policy, None, Optimizers(torch.optim.AdamW(policy.parameters(), lr=0.1)), Idle())


def test_the_encoding_round_trips_any_id_and_both_floors():
    ids = {"sao-1": Remembered(1.5, True, True), "line\nbreak é\"": Remembered(-2.0, False, True),
           "x" * 256: Remembered(3.25, True, False), "ü" * 256: Remembered(0.0, False, False)}
    for floor in (-math.inf, 0.75):
        back = decode_snapshot(encode_snapshot(MemorySnapshot(floor, ids)))
        assert back.floor == floor and back.ids == ids and list(back.ids) == list(ids)
    with pytest.raises(ValueError):
        decode_snapshot(encode_snapshot(MemorySnapshot(0.0, ids))[:-3])


def test_a_snapshot_stays_as_it_was_while_the_memory_changes():
    memory = IdMemory(horizon_s=100.0, capacity=2)
    memory.remember("a", 1.0, trained=False, seen=True)
    snapshot = memory.snapshot()
    memory.remember("a", 1.0, trained=True, seen=True)  # a flag turns on
    memory.remember("b", 2.0, trained=True, seen=True)
    memory.remember("c", 3.0, trained=True, seen=True)  # over capacity: "a" forgotten, the floor rises
    assert snapshot.floor == -math.inf and snapshot.ids == {"a": Remembered(1.0, False, True)}
    assert memory.floor == 1.0 and "a" not in memory and memory.get("b") == Remembered(2.0, True, True)


def test_a_checkpoint_keeps_the_id_memory_in_its_own_file_and_restores_it(tmp_path):
    joiner = RewardJoiner(RewardConfig(), max_pending=10)
    for k in range(12):  # two over capacity: the floor rose
        joiner.memory.remember(f"sao-{k}", 100.0 + k, trained=k % 2 == 0, seen=True)
    checkpointer = Checkpointer(tmp_path)
    path = checkpointer.save(gather_training_state(_trainables(), joiner, Progress(step=1, version=1), ONE_PROCESS))
    assert (path / "id_memory.bin").exists()
    meta = (path / "meta.json").read_text()
    assert "sao-5" not in meta and "memory" not in json.loads(meta)["state"]["joiner"]

    restored = RewardJoiner(RewardConfig(), max_pending=10)
    restore_training_state(Checkpointer(tmp_path), _trainables(), restored, ONE_PROCESS)
    assert restored.memory.floor == 101.0 and len(restored.memory) == 10
    assert restored.memory.get("sao-4") == Remembered(104.0, True, True)
    assert restored.memory.get("sao-5") == Remembered(105.0, False, True) and "sao-1" not in restored.memory


def test_a_checkpoint_with_the_id_memory_in_its_json_still_restores(tmp_path):
    joiner = RewardJoiner(RewardConfig(), max_pending=10)
    joiner.memory.remember("sao-old", 5.0, trained=True, seen=False)
    checkpointer = Checkpointer(tmp_path)
    state = LearnerState(step=1, version=1, offsets={}, joiner=joiner.state_dict())  # as written before
    trainables = _trainables()
    checkpointer.save(Checkpoint(state, {"policy": trainables.policy.state_dict()},
                                 {"policy": trainables.optimizers.policy.state_dict()}))
    restored = RewardJoiner(RewardConfig(), max_pending=10)
    restore_training_state(Checkpointer(tmp_path), trainables, restored, ONE_PROCESS)
    assert restored.memory.get("sao-old") == Remembered(5.0, True, False)


def test_retention_reads_the_version_without_parsing_meta_json(tmp_path):
    """Pruning and roll-back looked up each kept checkpoint's version in its meta.json, at every
    write: 0.17 s of JSON per checkpoint once the id memory was full."""
    checkpointer = Checkpointer(tmp_path, keep=1)
    checkpointer.pinned_versions = {1}
    for step in (1, 2):
        state = LearnerState(step=step, version=step, offsets={}, joiner={})
        checkpointer.save(Checkpoint(state, {"policy": {"w": torch.zeros(1)}}, {}))
    for _, path in checkpointer.checkpoints():
        (path / "meta.json").write_text("not read by retention")
    fresh = Checkpointer(tmp_path, keep=1)
    fresh.pinned_versions = {1}
    fresh.save(Checkpoint(LearnerState(step=3, version=3, offsets={}, joiner={}), {"policy": {"w": torch.zeros(1)}}, {}))
    assert [s for s, _ in fresh.checkpoints()] == [1, 3]
