"""The join and cut answers (``finish_reason`` abort: the client left, serving's deadline or shutdown):
not trained as rollouts of their own unless ``reward.train_aborted``; as a turn a continuation carries
in its history, trained there."""

from __future__ import annotations

from collections import Counter

from online_sao.config import RewardConfig
from online_sao.schemas import ABORTED
from tests.trainer.records import conversation, make_interaction, make_reward
from tests.trainer.test_join_trajectories import trained_tokens
from trainer.join import RewardJoiner


def joiner(**kw) -> RewardJoiner:
    return RewardJoiner(RewardConfig(window_s=10.0, **kw), max_pending=100)


def take_all(j: RewardJoiner):
    return j.pop_ready(max_rollouts=1000, token_budget=10**9)


def cut(record):
    return record.model_copy(update={"finish_reason": ABORTED})


def test_a_cut_answer_is_not_trained_and_its_rewards_are_not_applied():
    j = joiner(on_missing="default")
    j.add_reward(make_reward("a", 1.0), ts=0.5)  # read before its interaction: held
    j.add_interaction(cut(make_interaction("a")), ts=1.0)
    j.add_reward(make_reward("a", 0.25), ts=2.0)  # a judge scoring the cut text
    j.add_interaction(make_interaction("b"), ts=3.0)
    j.add_reward(make_reward("b", 0.5), ts=4.0)
    j.advance(100.0)  # every window closed: the default reward does not take "a" either
    assert [x.interaction.interaction_id for x in take_all(j)] == ["b"]
    assert j.counters.aborted == 1 and j.counters.late_rewards == 2 and j.counters.defaulted == 0
    assert j.counters.metrics()["join_aborted"] == 1.0
    j.add_interaction(cut(make_interaction("a")), ts=5.0)  # a copy of it is a duplicate, as for any finished id
    assert j.counters.duplicate_interactions == 1 and take_all(j) == []


def test_with_train_aborted_a_cut_answer_trains_on_its_reward():
    j = joiner(train_aborted=True)
    j.add_interaction(cut(make_interaction("a")), ts=1.0)
    j.add_reward(make_reward("a", 0.25), ts=2.0)
    (joined,) = take_all(j)
    assert joined.reward == 0.25 and j.counters.aborted == 0


def test_a_cut_continuation_leaves_its_parent_to_train_on_its_own():
    p, c = conversation(["p", "c"])
    j = joiner(on_missing="default", default_value=0.0)
    j.add_interaction(p, ts=0.0)
    j.add_interaction(cut(c), ts=5.0)  # the user went on, and left before the answer ended
    j.add_reward(make_reward("p", 1.0), ts=6.0)
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "p" and joined.reward == 1.0
    assert trained_tokens([joined]) == Counter({100: 1, 101: 1})
    assert j.counters.superseded == 0 and j.counters.aborted == 1


def test_a_continuation_of_a_cut_answer_trains_that_turn_once():
    p, c = conversation(["p", "c"])  # the client sent the cut answer back as history
    j = joiner()
    j.add_interaction(cut(p), ts=0.0)
    j.add_interaction(c, ts=5.0)
    j.add_reward(make_reward("c", 1.0), ts=6.0)
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "c" and joined.observed_turns == frozenset()
    assert trained_tokens([joined]) == Counter({100: 1, 101: 1, 200: 1, 201: 1})
