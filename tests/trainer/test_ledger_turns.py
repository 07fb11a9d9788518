"""An unrated first turn that trains inside its continuation reaches the ledger (trainer/ledger.py
``"turns"``), so an erasure finds it: only the continuation's id was written, and
``online-sao ledger redact <first turn>`` said it was never trained on."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from online_sao.config import RewardConfig
from streams.base import TopicPartition
from tests.trainer.records import conversation, make_reward
from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState, read_ledger, redact_ledger
from trainer.rollouts import to_rollouts
from trainer.join import RewardJoiner
from trainer.rank_zero import RankZero


def _continuation_trained_with_its_first_turn():
    p, c = conversation(["p", "c"])
    joiner = RewardJoiner(RewardConfig(window_s=60.0), max_pending=100)
    joiner.add_interaction(p, ts=1.0)
    joiner.add_interaction(c, ts=3.0)  # the user goes on (p unrated, waiting)
    joiner.add_reward(make_reward("c", 1.0), ts=4.0)
    taken = joiner.pop_ready(max_rollouts=10, token_budget=10**6)
    return to_rollouts(taken, {"invalid_rollouts": 0, "empty_rollouts": 0}, 10**6)


def test_a_rollout_names_the_earlier_turns_that_train_in_it():
    (rollout,) = _continuation_trained_with_its_first_turn()
    assert rollout.interaction_id == "c" and rollout.turns_of == ["p"]
    assert [t for t, a in zip(rollout.token_ids, rollout.action_mask) if a] == [100, 101, 200, 201]


def test_the_ledger_lists_the_absorbed_turn_and_an_erasure_finds_it(tmp_path):
    rollouts = _continuation_trained_with_its_first_turn()
    checkpointer = Checkpointer(tmp_path)
    books = SimpleNamespace(observe=lambda *args: None)
    rank0 = RankZero(checkpointer=checkpointer, feed=None, releases=SimpleNamespace(window=books), tracker=None,
                     producer=None, counters={}, segments=books, writer=None, exporter=None)
    rank0.record_step(1, rollouts, {}, refused=False)
    state = LearnerState(step=1, version=1, offsets={TopicPartition("sao.interactions", 0): 1}, joiner={"waiting": []})
    checkpointer.save(Checkpoint(state, models={"policy": {"w": torch.zeros(2)}}, optimizers={}))

    assert read_ledger(tmp_path) == [(1, "c")]  # the rollouts, as before
    assert read_ledger(tmp_path, turns=True) == [(1, "c"), (1, "p")]
    assert redact_ledger(tmp_path, {"p"}) == 1
    assert read_ledger(tmp_path, turns=True) == [(1, "c"), (1, "-")]
    assert Checkpointer(tmp_path).resume().state.step == 1  # the segment kept its length
