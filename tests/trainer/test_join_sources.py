"""RewardJoiner with several reward sources: which are trained on, and waiting for all of them."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from online_sao.config import RewardConfig
from tests.trainer.records import conversation, make_interaction, make_reward
from trainer.join import RewardJoiner


def joiner(**kw) -> RewardJoiner:
    max_pending = kw.pop("max_pending", 100)
    return RewardJoiner(RewardConfig(window_s=10.0, **kw), max_pending=max_pending)


def take_all(j: RewardJoiner):
    return j.pop_ready(max_rollouts=1000, token_budget=10**9)


def test_without_a_wait_the_first_source_is_trained_on_and_a_later_one_is_late():
    j = joiner(aggregation="mean")
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0, source="judge"), ts=1.0)
    (joined,) = take_all(j)  # a step takes it before the user's thumbs arrive
    j.add_reward(make_reward("a", 0.0, source="user"), ts=5.0)
    assert joined.reward == 1.0 and j.counters.late_rewards == 1


def test_an_interaction_waits_for_every_listed_source_and_their_rewards_combine():
    j = joiner(aggregation="mean", wait_for_sources=["judge", "user"])
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0, source="judge"), ts=1.0)
    assert take_all(j) == [] and j.num_waiting == 1
    j.add_reward(make_reward("a", 0.5, source="judge"), ts=2.0)  # a second judge rating: still no user
    assert take_all(j) == []
    j.add_reward(make_reward("a", 0.0, source="user"), ts=5.0)
    (joined,) = take_all(j)
    assert joined.reward == pytest.approx(0.5)  # (1.0 + 0.5 + 0.0) / 3
    assert (j.counters.joined, j.counters.missing_sources, j.counters.late_rewards) == (1, 0, 0)
    assert joined.source_rewards == {"judge": 0.75, "user": 0.0}  # each source's own mean, for the books


def test_rewards_read_before_their_interaction_count_towards_the_wait():
    j = joiner(aggregation="sum", wait_for_sources=["judge", "user"])
    j.add_reward(make_reward("a", 1.0, source="user"), ts=0.5)
    j.add_reward(make_reward("a", 2.0, source="judge"), ts=0.6)
    j.add_interaction(make_interaction("a"), ts=1.0)
    (joined,) = take_all(j)
    assert joined.reward == 3.0 and joined.source_rewards == {"judge": 2.0, "user": 1.0}


def test_a_window_closing_with_some_sources_trains_on_what_they_said_and_counts_it():
    j = joiner(wait_for_sources=["judge", "user"], on_missing="default", default_value=-1.0)
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_interaction(make_interaction("b"), ts=0.0)
    j.add_reward(make_reward("a", 0.7, source="judge"), ts=1.0)
    j.advance(10.5)
    assert sorted((x.interaction.interaction_id, x.reward, x.rewarded) for x in take_all(j)) == [
        ("a", 0.7, True), ("b", -1.0, False)]  # b had no reward at all: the default, as before
    assert (j.counters.missing_sources, j.counters.defaulted) == (1, 1)


def test_an_interaction_read_after_its_window_with_some_sources_trains_on_them():
    j = joiner(wait_for_sources=["judge", "user"])
    j.add_reward(make_reward("a", 0.4, source="user"), ts=3.0)  # held: read before its interaction
    j.advance(12.0)  # the window of "a" (record time 1.0) has closed when it is read
    j.add_interaction(make_interaction("a"), ts=1.0)
    assert [x.reward for x in take_all(j)] == [0.4] and j.counters.missing_sources == 1


@pytest.mark.parametrize("restart", [False, True])
def test_a_source_read_after_the_window_closed_is_late_not_applied(restart):
    """The window closed with the judge's rating only (missing_sources); the user's, stamped inside
    the window (9 s) but read after it closed (clock at 12 s), was applied while the interaction
    waited for a step (mean 0.5), and late had a step taken it first. A checkpoint keeps it closed."""
    j = joiner(aggregation="mean", wait_for_sources=["judge", "user"])
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0, source="judge"), ts=1.0)
    j.add_interaction(make_interaction("x"), ts=12.0)  # a's window (ends at 10 s) closes
    if restart:
        j, before = joiner(aggregation="mean", wait_for_sources=["judge", "user"]), j
        j.load_state_dict(json.loads(json.dumps(before.state_dict())))
    j.add_reward(make_reward("a", 0.0, source="user"), ts=9.0)
    (joined,) = take_all(j)
    assert (joined.interaction.interaction_id, joined.reward, joined.source_rewards) == ("a", 1.0, {"judge": 1.0})
    assert (j.counters.missing_sources, j.counters.late_rewards, j.counters.joined) == (1, 1, 1)


def test_a_full_buffer_makes_a_partly_rated_interaction_ready_instead_of_dropping_it():
    j = joiner(wait_for_sources=["judge", "user"], max_pending=1)
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 0.9, source="judge"), ts=0.5)
    j.add_interaction(make_interaction("b"), ts=1.0)  # "a" leaves the full buffer
    assert [x.reward for x in take_all(j)] == [0.9]
    assert (j.counters.missing_sources, j.counters.evicted) == (1, 0)


def test_rewards_from_a_source_left_out_are_counted_and_never_applied():
    j = joiner(sources=["judge"])
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 0.0, source="user"), ts=1.0)
    assert take_all(j) == [] and j.num_waiting == 1
    j.add_reward(make_reward("a", 0.8, source="judge"), ts=2.0)
    assert [x.reward for x in take_all(j)] == [0.8]
    assert (j.counters.rewards, j.counters.ignored_rewards, j.counters.joined) == (2, 1, 1)


def test_a_continuation_absorbs_a_partly_rated_ancestor_with_its_rewards():
    first, second = conversation(["t0", "t1"])
    j = joiner(wait_for_sources=["judge", "user"])
    j.add_interaction(first, ts=0.0)
    j.add_reward(make_reward("t0", 0.25, source="judge", turns={0: 0.25}), ts=0.5)
    j.add_interaction(second, ts=1.0)  # absorbs t0, still waiting for its user rating
    j.add_reward(make_reward("t1", 1.0, source="judge"), ts=1.5)
    j.add_reward(make_reward("t1", 1.0, source="user"), ts=1.6)
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "t1" and joined.reward == 1.0
    assert joined.turn_rewards[0] == pytest.approx(0.5)  # its own per-turn 0.25 and t0's final 0.25 add up
    assert j.counters.superseded == 1


def test_the_wait_survives_a_checkpoint():
    j = joiner(wait_for_sources=["judge", "user"], aggregation="mean")
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0, source="judge"), ts=1.0)
    restored = joiner(wait_for_sources=["judge", "user"], aggregation="mean")
    restored.load_state_dict(json.loads(json.dumps(j.state_dict())))
    restored.add_reward(make_reward("a", 0.0, source="judge"), ts=2.0)
    assert take_all(restored) == []  # two judge ratings: still waiting for the user
    restored.add_reward(make_reward("a", 0.5, source="user"), ts=3.0)
    assert [x.reward for x in take_all(restored)] == [0.5]


@pytest.mark.parametrize("settings,message", [
    ({"wait_for_sources": ["judge", "judge"]}, "twice"),
    ({"sources": ["user"], "wait_for_sources": ["judge"]}, "never applied"),
])
def test_contradictory_source_settings_are_refused(settings, message):
    with pytest.raises(ValidationError, match=message):
        RewardConfig(**settings)
