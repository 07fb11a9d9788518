"""Checkpoint round trip, retention, crash leftovers and the ledger protocol."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from online_sao.algorithms import linear_warmup
from streams.base import TopicPartition
from trainer.checkpoint import (Checkpoint, Checkpointer, LearnerState, flatten_tensors, read_ledger,
                                redact_ledger, unflatten_tensors)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].weight = nn.Parameter(torch.randn(2, 8))
    return model


def _train(model: nn.Module, optimizer, scheduler, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(3, 4, generator=g)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def _state(step: int, **kw) -> LearnerState:
    return LearnerState(step=step, version=step, offsets={TopicPartition("sao.interactions", 0): 10 * step},
                        joiner={"watermark": 1.5, "waiting": []}, **kw)


def _snapshot(model, optimizer, scheduler, step: int) -> Checkpoint:
    return Checkpoint(_state(step, algorithm={"reward_window": [1.0, 2.0]}, mlflow_run_id="run-1",
                             protected_versions=[3], counters={"dead_letters": 2.0}),
                      models={"policy": model.state_dict()},
                      optimizers={"policy": optimizer.state_dict(), "critic_scheduler": scheduler.state_dict()})


def test_round_trip_resumes_training_bit_identically(tmp_path):
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = linear_warmup(optimizer, 5)
    _train(model, optimizer, scheduler, steps=3, seed=1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_snapshot(model, optimizer, scheduler, step=3))

    loaded = Checkpointer(tmp_path).resume()
    assert loaded.state.step == 3 and loaded.state.mlflow_run_id == "run-1"
    assert loaded.state.offsets == {TopicPartition("sao.interactions", 0): 30}
    assert loaded.state.algorithm == {"reward_window": [1.0, 2.0]}
    assert loaded.state.protected_versions == [3] and loaded.state.counters == {"dead_letters": 2.0}
    restored = _model(99)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    restored_sched = linear_warmup(restored_opt, 5)
    restored.load_state_dict(loaded.models["policy"])
    restored_opt.load_state_dict(loaded.optimizers["policy"])
    restored_sched.load_state_dict(loaded.optimizers["critic_scheduler"])

    _train(model, optimizer, scheduler, steps=2, seed=2)
    _train(restored, restored_opt, restored_sched, steps=2, seed=2)
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert restored_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_no_pickle_only_safetensors_and_json(tmp_path):
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = linear_warmup(optimizer, 2)
    _train(model, optimizer, scheduler, 1, 0)
    path = Checkpointer(tmp_path).save(_snapshot(model, optimizer, scheduler, step=1))
    assert sorted(p.name for p in path.iterdir()) == ["index.json", "meta.json", "optim.json", "optim.safetensors",
                                                      "policy.safetensors"]
    json.loads((path / "optim.json").read_text())
    assert json.loads((path / "index.json").read_text())["version"] == 1


def test_keeps_the_last_two_and_resume_picks_newest(tmp_path):
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2, 3):
        ckpt.save(Checkpoint(_state(step), models={"policy": {"w": torch.full((2,), float(step))}}, optimizers={}))
    assert [s for s, _ in ckpt.checkpoints()] == [2, 3]
    loaded = Checkpointer(tmp_path).resume()
    assert loaded.state.step == 3 and loaded.models["policy"]["w"].tolist() == [3.0, 3.0]
    with pytest.raises(FileExistsError):
        ckpt.save(Checkpoint(_state(3), models={}, optimizers={}))


def test_ledger_lines_of_uncommitted_steps_are_cut_on_resume(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.record_trained(1, ["a", "b"])
    ckpt.save(Checkpoint(_state(1), models={}, optimizers={}))
    ckpt.record_trained(2, ["c"])

    def killed(*args):
        raise KeyboardInterrupt("killed before the rename")

    # a crash after the ledger append and the files, before the rename: the commit never happened
    monkeypatch.setattr("trainer.checkpoint.os.rename", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(Checkpoint(_state(2), models={}, optimizers={}))
    monkeypatch.undo()
    assert list(tmp_path.glob(".tmp-*"))
    assert [i for _, i in read_ledger(ckpt.ledger_path)] == ["a", "b", "c"]

    loaded = Checkpointer(tmp_path).resume()
    assert loaded.state.step == 1
    assert read_ledger(tmp_path) == [(1, "a"), (1, "b")]
    assert not list(tmp_path.glob(".tmp-*"))


def test_resume_without_checkpoint_empties_the_ledger(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.record_trained(1, ["a"])
    monkeypatch.setattr("trainer.checkpoint.save_file", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):  # the first checkpoint fails after its ledger lines were appended
        ckpt.save(Checkpoint(_state(1), models={"policy": {}}, optimizers={}))
    monkeypatch.undo()
    assert read_ledger(tmp_path) == [(1, "a")]
    assert Checkpointer(tmp_path).resume() is None
    assert read_ledger(tmp_path) == []


def test_a_ledger_shorter_than_the_checkpoint_is_an_error(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.record_trained(1, ["a"])
    ckpt.save(Checkpoint(_state(1), models={}, optimizers={}))
    (ckpt.ledger_path / "00000001.jsonl").write_text("")  # the current segment, which the checkpoint covers
    with pytest.raises(RuntimeError, match="ledger segment"):
        Checkpointer(tmp_path).resume()


def test_a_redacted_ledger_keeps_its_length_and_the_learner_resumes_on_it(tmp_path):
    """The erasure procedure: a user's ids overwritten in place. Deleting their lines (what the docs
    said before) made the ledger shorter than the checkpoint covers, and the learner refused to start."""
    ckpt = Checkpointer(tmp_path)
    user = "sao-18c2-é\"x"  # escapes and a non-ASCII character: the encoded length is kept
    ckpt.record_trained(1, ["a", user])
    ckpt.record_trained(2, [user, "bb"], refused=True)
    ckpt.save(Checkpoint(_state(2), models={}, optimizers={}))
    segment = ckpt.ledger_path / "00000001.jsonl"
    size = segment.stat().st_size

    assert redact_ledger(ckpt.ledger_path, {user, "not-there"}) == 2
    assert segment.stat().st_size == size
    dashes = "-" * (len(json.dumps(user)) - 2)
    assert read_ledger(ckpt.ledger_path) == [(1, "a"), (1, dashes), (2, dashes), (2, "bb")]
    assert read_ledger(ckpt.ledger_path, refused=True) == [(2, dashes), (2, "bb")]
    assert user.encode() not in segment.read_bytes()
    assert Checkpointer(tmp_path).resume().state.step == 2
    assert redact_ledger(ckpt.ledger_path, {"nobody"}) == 0


def test_flatten_keeps_int_keys_and_refuses_objects():
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_tensors({"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"betas": (0.9, 0.99)}]}, tensors)
    back = unflatten_tensors(json.loads(json.dumps(tree)), tensors)
    assert back["state"][0]["step"].item() == 3.0 and back["groups"][0]["betas"] == [0.9, 0.99]
    with pytest.raises(TypeError, match="object"):
        flatten_tensors({"x": object()}, {})


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """Pruning renames a checkpoint out of the step-* names before deleting it: killed mid-delete
    (here: rmtree removes meta.json, then the process dies), the next start finds whole checkpoints
    only, and saves and prunes on."""
    import trainer.checkpoint as checkpoint_module

    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save(Checkpoint(_state(step), models={"policy": {"w": torch.full((2,), float(step))}}, optimizers={}))

    def killed_mid_delete(path):
        (path / "meta.json").unlink()
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(Checkpoint(_state(3), models={"policy": {"w": torch.full((2,), 3.0)}}, optimizers={}))
    monkeypatch.undo()

    again = Checkpointer(tmp_path)
    assert again.resume().state.step == 3
    assert [s for s, _ in again.checkpoints()] == [2, 3] and not list(tmp_path.glob(".tmp-*"))
    again.save(Checkpoint(_state(4), models={"policy": {"w": torch.full((2,), 4.0)}}, optimizers={}))
    assert [s for s, _ in again.checkpoints()] == [3, 4]
