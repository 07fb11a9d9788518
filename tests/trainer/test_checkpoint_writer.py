"""Checkpoints written in the background: a snapshot of the moment, in order, offsets after the commit."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from streams.base import TopicPartition
from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState, StagedCheckpoint, read_ledger
from trainer.checkpoint_writer import CheckpointWriter

WAIT_S = 10.0
"""Generous bound on a test thread's wait (a stuck writer fails the test instead of hanging it)."""


def _checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Checkpoint:
    state = LearnerState(step=step, version=step, offsets={TopicPartition("sao.interactions", 0): 10 * step},
                         joiner={"waiting": []})
    return Checkpoint(state, {"policy": model.state_dict()}, {"policy": optimizer.state_dict()})


class GatedCheckpointer(Checkpointer):
    """A real checkpointer whose writes start only when the test opens the gate."""

    def __init__(self, root, fail: bool = False) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.fail = fail
        self.writing = threading.Event()

    def write(self, staged: StagedCheckpoint):
        self.writing.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if self.fail:
            raise OSError("disk full")
        return super().write(staged)


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _train_on(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


def test_the_checkpoint_holds_the_state_when_it_was_taken_not_after_training_on(tmp_path, trained):
    model, optimizer = trained
    weight_then = model.weight.detach().clone()
    exp_avg_then = optimizer.state[model.weight]["exp_avg"].clone()
    checkpointer = GatedCheckpointer(tmp_path)
    commits = []
    writer = CheckpointWriter(checkpointer, background=True)
    writer.save(_checkpoint(model, optimizer, step=1), after_commit=lambda: commits.append(1))
    assert checkpointer.writing.wait(WAIT_S)
    _train_on(model, optimizer)  # the learner goes on while the write waits
    assert not torch.equal(model.weight, weight_then)
    writer.poll()
    assert writer.busy and commits == []  # not committed: the offsets wait too
    checkpointer.gate.set()
    writer.wait()
    assert commits == [1] and not writer.busy
    loaded = Checkpointer(tmp_path).resume()
    assert loaded.state.step == 1
    assert torch.equal(loaded.models["policy"]["weight"], weight_then)
    assert torch.equal(loaded.optimizers["policy"]["state"][0]["exp_avg"], exp_avg_then)


def test_the_next_save_waits_for_the_write_in_flight_and_the_ledger_stays_in_step_order(tmp_path, trained):
    model, optimizer = trained
    checkpointer = GatedCheckpointer(tmp_path)
    commits = []
    writer = CheckpointWriter(checkpointer, background=True)
    checkpointer.record_trained(1, ["a", "b"])
    writer.save(_checkpoint(model, optimizer, step=1), after_commit=lambda: commits.append(1))
    checkpointer.record_trained(2, ["c"])  # a step trained while checkpoint 1 is written
    saved = threading.Thread(target=writer.save,
                             args=(_checkpoint(model, optimizer, step=2), lambda: commits.append(2)))
    saved.start()
    saved.join(timeout=0.3)
    assert saved.is_alive() and commits == []  # blocked behind the first write
    checkpointer.gate.set()
    saved.join(timeout=WAIT_S)
    assert not saved.is_alive() and commits == [1]
    writer.wait()
    assert commits == [1, 2]
    assert read_ledger(checkpointer.ledger_path) == [(1, "a"), (1, "b"), (2, "c")]
    first, second = (Checkpointer(tmp_path).load(path).state.ledger_bytes for _, path in checkpointer.checkpoints())
    first_line = b'{"step":1,"ids":["a","b"]}\n'
    assert first == len(first_line) and second == len(first_line) + len(b'{"step":2,"ids":["c"]}\n')


def _first_save(checkpointer: Checkpointer, trained, background: bool = True) -> tuple[CheckpointWriter, list[int]]:
    """A writer over ``checkpointer`` that has saved step 1; the list collects its after-commit calls."""
    model, optimizer = trained
    commits: list[int] = []
    writer = CheckpointWriter(checkpointer, background=background)
    writer.save(_checkpoint(model, optimizer, step=1), after_commit=lambda: commits.append(1))
    return writer, commits


def test_a_failed_write_raises_at_wait_and_commits_no_offsets(tmp_path, trained):
    checkpointer = GatedCheckpointer(tmp_path, fail=True)
    writer, commits = _first_save(checkpointer, trained)
    checkpointer.gate.set()
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    assert commits == [] and checkpointer.checkpoints() == []


def test_in_the_foreground_the_commit_and_its_offsets_happen_inside_save(tmp_path, trained):
    checkpointer = Checkpointer(tmp_path)
    writer, commits = _first_save(checkpointer, trained, background=False)
    assert commits == [1] and not writer.busy and [s for s, _ in checkpointer.checkpoints()] == [1]


def test_close_lets_the_write_finish_but_runs_nothing_after_it(tmp_path, trained):
    checkpointer = GatedCheckpointer(tmp_path)
    writer, commits = _first_save(checkpointer, trained)
    checkpointer.gate.set()
    writer.close()
    assert commits == [] and [s for s, _ in checkpointer.checkpoints()] == [1]
