"""The join carries the named scores of reward records (``Reward.scores``) to the rollout."""

from __future__ import annotations

import json

import pytest

from online_sao.config import RewardConfig
from tests.trainer.records import conversation, make_interaction, make_reward
from trainer.join import RewardJoiner


def joiner(**kw) -> RewardJoiner:
    return RewardJoiner(RewardConfig(window_s=10.0, **kw), max_pending=100)


def take_all(j: RewardJoiner):
    return j.pop_ready(max_rollouts=1000, token_budget=10**9)


@pytest.mark.parametrize("mode,quality", [("first", 0.2), ("last", 0.6), ("mean", 0.4), ("sum", 0.4)])
def test_scores_of_several_rewards_combine_by_name(mode, quality):
    """Two judges' readings: quality 0.2 then 0.6; only the second gives style. ``sum`` adds the
    rewards (1 + 2 = 3) but takes the mean of the scores (a measurement, not a payment)."""
    j = joiner(aggregation=mode)
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0, scores={"quality": 0.2}), ts=1.0)
    j.add_reward(make_reward("a", 2.0, scores={"quality": 0.6, "style": 0.9}), ts=2.0)
    (joined,) = take_all(j)
    assert joined.scores == {"quality": pytest.approx(quality), "style": 0.9}
    rollout = joined.to_rollout()
    assert rollout.scores == joined.scores
    assert rollout.total_reward == {"first": 1.0, "last": 2.0, "mean": 1.5, "sum": 3.0}[mode]


def test_a_reward_without_scores_leaves_the_rollout_without_any():
    j = joiner()
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0), ts=1.0)
    (joined,) = take_all(j)
    assert joined.scores == {} and joined.to_rollout().scores == {}


def test_held_scores_join_when_their_interaction_arrives():
    j = joiner()
    j.add_reward(make_reward("a", 1.0, scores={"quality": 0.3}), ts=0.5)
    j.add_interaction(make_interaction("a"), ts=1.0)
    (joined,) = take_all(j)
    assert joined.scores == {"quality": 0.3}


def test_an_ancestors_scores_do_not_become_the_continuations():
    """The reward of an absorbed turn lands on that turn; its scores measured another answer."""
    first, second = conversation(["t1", "t2"])
    j = joiner()
    j.add_interaction(first, ts=0.0)
    j.add_interaction(second, ts=1.0)  # absorbs t1, still waiting
    j.add_reward(make_reward("t1", 0.5, scores={"quality": 0.1}), ts=1.5)
    j.add_reward(make_reward("t2", 1.0, scores={"quality": 0.9}), ts=2.0)
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "t2"
    assert joined.turn_rewards == {0: 0.5} and joined.scores == {"quality": 0.9}


def test_scores_survive_a_checkpoint_and_old_checkpoints_load():
    j = joiner()
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("b", 1.0, scores={"quality": 0.7}), ts=0.5)  # held: b not read yet
    j.add_reward(make_reward("a", 1.0, scores={"quality": 0.4}), ts=1.0)
    state = json.loads(json.dumps(j.state_dict()))
    restored = joiner()
    restored.load_state_dict(state)
    restored.add_interaction(make_interaction("b"), ts=2.0)
    assert {x.interaction.interaction_id: x.scores for x in take_all(restored)} == {"a": {"quality": 0.4},
                                                                                   "b": {"quality": 0.7}}
    for entry in state["ready"]:  # as written before rewards carried scores
        for contribution in entry["contributions"]:
            del contribution["scores"]
    for _, contributions in state["held"]:
        for contribution in contributions:
            del contribution["scores"]
    old = joiner()
    old.load_state_dict(state)
    old.add_interaction(make_interaction("b"), ts=2.0)
    assert [x.scores for x in take_all(old)] == [{}, {}]
