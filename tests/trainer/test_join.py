"""RewardJoiner: windows on record time, aggregation, late and early rewards, state."""

from __future__ import annotations

import json

import pytest

from online_sao.config import RewardConfig
from trainer.join import RewardJoiner, aggregate
from online_sao.schemas import Reward
from tests.trainer.records import conversation, make_interaction, make_reward


def joiner(**kw) -> RewardJoiner:
    max_pending = kw.pop("max_pending", 100)
    return RewardJoiner(RewardConfig(window_s=10.0, **kw), max_pending=max_pending)


def take_all(j: RewardJoiner, group_size: int = 1):
    return j.pop_ready(max_rollouts=1000, token_budget=10**9, group_size=group_size)


@pytest.mark.parametrize("mode,expected", [("first", 1.0), ("last", 3.0), ("sum", 6.0), ("mean", 2.0)])
def test_aggregation_modes(mode, expected):
    j = joiner(aggregation=mode)
    j.add_interaction(make_interaction("a", turn_ends=(1,)), ts=0.0)
    for i, value in enumerate([1.0, 2.0, 3.0]):
        j.add_reward(make_reward("a", value, turns={0: 10.0 * value}), ts=1.0 + i)
    (joined,) = take_all(j)
    assert joined.reward == expected
    assert joined.turn_rewards == {0: 10.0 * expected}
    assert joined.rewarded
    assert j.counters.joined == 1 and j.counters.rewards == 3


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="median"):
        aggregate([1.0], "median")


def test_rewarded_interaction_is_ready_at_once_and_unrewarded_waits():
    j = joiner()
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_interaction(make_interaction("b"), ts=0.5)
    j.add_reward(make_reward("a", 1.0), ts=1.0)
    assert j.ready_stats() == (1, 3)
    assert [x.interaction.interaction_id for x in take_all(j)] == ["a"]
    assert j.num_waiting == 1


@pytest.mark.parametrize("on_missing", ["default", "drop"])
def test_window_close_without_reward(on_missing):
    j = joiner(on_missing=on_missing, default_value=-0.5)
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.advance(10.0)  # the window is inclusive: a reward at exactly ts + window still joins
    assert j.ready_stats() == (0, 0)
    j.advance(10.5)
    ready = take_all(j)
    if on_missing == "default":
        assert [(x.reward, x.rewarded) for x in ready] == [(-0.5, False)]
        assert (j.counters.defaulted, j.counters.dropped_no_reward) == (1, 0)
    else:
        assert ready == []
        assert (j.counters.defaulted, j.counters.dropped_no_reward) == (0, 1)
    j.add_reward(make_reward("a", 1.0), ts=11.0)  # too late either way
    assert j.counters.late_rewards == 1
    assert take_all(j) == []


def test_windows_close_on_record_time_not_wall_clock():
    j = joiner(on_missing="default")
    j.add_interaction(make_interaction("a"), ts=1_000.0)
    j.add_interaction(make_interaction("b"), ts=1_005.0)  # watermark 1005: a's window is still open
    assert j.ready_stats() == (0, 0)
    j.add_reward(make_reward("zzz", 0.0), ts=1_012.0)  # any record moves the clock: a closes, b stays
    assert [x.interaction.interaction_id for x in take_all(j)] == ["a"]


def test_reward_after_training_is_counted_and_never_applied_twice():
    j = joiner(aggregation="sum")
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0), ts=1.0)
    (first,) = take_all(j)
    assert first.reward == 1.0
    j.add_reward(make_reward("a", 5.0), ts=2.0)  # still within the window, but already trained on
    assert j.counters.late_rewards == 1
    assert take_all(j) == []


def test_reward_before_interaction_is_held_and_joined():
    j = joiner(aggregation="sum")
    j.add_reward(make_reward("a", 1.0), ts=5.0)
    j.add_reward(make_reward("a", 2.0), ts=5.5)
    assert j.counters.early_rewards == 2 and j.num_held_rewards == 1
    j.add_interaction(make_interaction("a"), ts=4.0)
    (joined,) = take_all(j)
    assert joined.reward == 3.0 and j.num_held_rewards == 0


def test_held_reward_expires_when_its_interaction_never_comes():
    j = joiner()
    j.add_reward(make_reward("ghost", 1.0), ts=0.0)
    j.advance(10.5)
    assert j.num_held_rewards == 0 and j.counters.expired_rewards == 1


def test_held_rewards_of_one_interaction_expire_each_on_its_own_time():
    j = joiner(aggregation="mean")
    j.add_reward(make_reward("a", 1.0), ts=0.0)
    j.add_reward(make_reward("a", 3.0), ts=5.0)
    j.add_interaction(make_interaction("a"), ts=12.0)  # past the first reward's window, within the second's
    assert [x.reward for x in take_all(j)] == [3.0]
    assert j.counters.expired_rewards == 1


def test_a_held_reward_past_its_window_is_not_applied_whatever_the_order_it_was_held_in():
    j = joiner()
    j.add_reward(make_reward("a", 1.0), ts=0.0)
    j.add_reward(make_reward("a", 2.0), ts=1.0)
    j.add_reward(make_reward("b", 3.0), ts=7.0)  # held after a's: the release of held rewards stops at it
    j.advance(11.0)  # a's first reward expires; its second (window to 11) is kept
    j.add_interaction(make_interaction("a"), ts=12.0)  # a's second reward has expired by now too
    assert take_all(j) == [] and j.counters.expired_rewards == 2


def test_duplicate_interaction_is_ignored():
    j = joiner()
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0), ts=0.5)
    take_all(j)
    j.add_interaction(make_interaction("a"), ts=1.0)
    assert j.counters.duplicate_interactions == 1
    assert j.num_waiting == 0 and take_all(j) == []


def test_pop_respects_token_budget_and_max_rollouts():
    j = joiner()
    for i in range(5):
        j.add_interaction(make_interaction(f"i{i}"), ts=float(i))  # 3 action tokens each
        j.add_reward(make_reward(f"i{i}", 1.0), ts=float(i))
    assert len(j.pop_ready(max_rollouts=10, token_budget=6)) == 2
    assert len(j.pop_ready(max_rollouts=1, token_budget=100)) == 1
    assert [x.interaction.interaction_id for x in take_all(j)] == ["i3", "i4"]


def test_grpo_groups_wait_until_complete():
    j = joiner()
    prompts = {"a1": (1,), "b1": (2,), "a2": (1,), "b2": (2,), "a3": (1,)}
    for i, (iid, prompt) in enumerate(prompts.items()):
        j.add_interaction(make_interaction(iid, prompt=prompt), ts=float(i))
        j.add_reward(make_reward(iid, 1.0), ts=float(i))
    assert j.ready_stats(group_size=2) == (4, 12)
    taken = take_all(j, group_size=2)
    assert [(x.interaction.interaction_id, x.group_id) for x in taken] == [("a1", 0), ("a2", 0), ("b1", 1), ("b2", 1)]
    assert j.ready_stats(group_size=2) == (0, 0) and j.ready_stats() == (1, 3)


def _ready(j: RewardJoiner, iid: str, prompt: tuple[int, ...], ts: float, reward: float | None = 1.0) -> None:
    j.add_interaction(make_interaction(iid, prompt=prompt), ts=ts)
    if reward is not None:
        j.add_reward(make_reward(iid, reward), ts=ts)


def test_an_incomplete_grpo_group_is_handed_out_after_the_timeout_and_counted():
    j = joiner(group_timeout_s=5.0)
    _ready(j, "a1", (1,), 0.0)
    _ready(j, "b1", (2,), 1.0)
    _ready(j, "b2", (2,), 1.5, reward=None)  # its reward was dropped: b's group never completes
    _ready(j, "a2", (1,), 2.0)
    assert [x.interaction.interaction_id for x in take_all(j, group_size=2)] == ["a1", "a2"]
    _ready(j, "c1", (3,), 6.0)  # b1, ready at 1.0, has waited 5.0 s: not past the timeout
    assert j.ready_stats(group_size=2) == (0, 0)
    _ready(j, "c2", (3,), 6.5, reward=None)  # 5.5 s: b1 goes alone; c1 (0.5 s) keeps waiting
    assert j.ready_stats(group_size=2) == (1, 3)
    assert [(x.interaction.interaction_id, x.group_id) for x in take_all(j, group_size=2)] == [("b1", 0)]
    assert (j.counters.complete_groups, j.counters.incomplete_groups) == (1, 1)
    assert j.counters.group_wait_s == pytest.approx(2.0 + 5.0)  # a: ready 0.0 -> complete 2.0; b: the timeout
    metrics = j.counters.metrics()
    assert metrics["join_incomplete_groups"] == 1.0 and metrics["join_group_wait_s"] == pytest.approx(7.0)


def test_without_a_group_timeout_an_incomplete_group_waits_forever():
    j = joiner(group_timeout_s=None)
    _ready(j, "b1", (2,), 1.0)
    _ready(j, "z", (9,), 9.0)
    assert j.ready_stats(group_size=2) == (0, 0) and j.counters.incomplete_groups == 0


def test_past_max_pending_members_of_incomplete_groups_the_oldest_group_is_handed_out():
    """No group timeout, prompts that rarely repeat: members of incomplete groups were never handed out,
    and the feed's backpressure, which counts what pop_ready could hand out, never saw them: held
    without bound, each readiness check scanning them all."""
    j = joiner(group_timeout_s=None, max_pending=20)
    _ready(j, "a1", (1,), 0.0)
    for i in range(10):
        _ready(j, f"u{i}", (100 + i,), 1.0 + i)
    _ready(j, "a2", (1,), 11.0)
    for i in range(10, 20):
        _ready(j, f"u{i}", (100 + i,), 2.0 + i)
    assert j.ready_counts(group_size=4) == (1, 2, 6)  # 22 held: a's group, the oldest, goes as it is
    taken = take_all(j, group_size=4)
    assert [(x.interaction.interaction_id, x.group_id) for x in taken] == [("a1", 0), ("a2", 0)]
    assert (j.counters.complete_groups, j.counters.incomplete_groups) == (0, 1)
    assert j.ready_counts(group_size=4) == (0, 0, 0)
    _ready(j, "u20", (120,), 30.0)  # 21 held: u0, the oldest, goes alone
    assert [x.interaction.interaction_id for x in take_all(j, group_size=4)] == ["u0"]


def test_group_wait_state_survives_a_checkpoint():
    j = joiner(group_timeout_s=5.0)
    j.add_interaction(make_interaction("b1", prompt=(2,)), ts=0.0)
    j.add_reward(make_reward("b1", 1.0), ts=2.0)  # ready at 2.0, not at its interaction's 0.0
    _ready(j, "z", (9,), 3.0)
    restored = joiner(group_timeout_s=5.0)
    restored.load_state_dict(json.loads(json.dumps(j.state_dict())))
    _ready(restored, "y", (8,), 6.5)  # b1 has waited 4.5 s
    assert restored.ready_stats(group_size=2) == (0, 0)
    _ready(restored, "x", (7,), 7.5)  # 5.5 s
    assert [x.interaction.interaction_id for x in take_all(restored, group_size=2)] == ["b1"]


def test_bounded_memory_evicts_oldest_waiting():
    j = joiner(max_pending=2)
    for i in range(3):
        j.add_interaction(make_interaction(f"i{i}"), ts=float(i))
    assert j.num_waiting == 2 and j.counters.evicted == 1
    j.add_reward(make_reward("i0", 1.0), ts=3.0)  # its interaction was given up
    assert j.counters.late_rewards == 1


def test_evicting_held_rewards_counts_each_reward_given_up():
    """Room for one id's held rewards: a's three are given up for b's. They counted 1, so 4 rewards
    read were 1 held and 1 given up: two unaccounted for."""
    j = joiner(max_pending=1)
    for value in (0.1, 0.2, 0.3):
        j.add_reward(make_reward("a", value), ts=1.0)
    j.add_reward(make_reward("b", 1.0), ts=2.0)
    assert (j.counters.rewards, j.counters.evicted, j.num_held_rewards) == (4, 3, 1)


@pytest.mark.parametrize("on_missing", ["default", "drop"])
def test_a_reward_read_after_its_interactions_window_closed_is_late_and_not_applied(on_missing):
    """Stamped inside a's window (9 s, window ending at 10 s) but read once the clock was at 12 s:
    with on_missing default it was applied to the defaulted interaction waiting for a step (counted
    as neither joined nor late), and late had a step taken a first; with drop it was late."""
    j = joiner(on_missing=on_missing, default_value=-1.0)
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_interaction(make_interaction("x"), ts=12.0)  # the clock passes the end of a's window
    j.add_reward(make_reward("a", 1.0), ts=9.0)
    taken = [(x.interaction.interaction_id, x.reward, x.rewarded) for x in take_all(j)]
    assert taken == ([("a", -1.0, False)] if on_missing == "default" else [])
    assert (j.counters.late_rewards, j.counters.joined) == (1, 0)


@pytest.mark.parametrize("step_first", [False, True])
def test_a_reward_read_after_a_rated_interactions_window_ended_is_late_whether_or_not_a_step_came_first(step_first):
    """a rated at 1 s, ready for a step; the clock at 12 s passes its window's end (10 s); a second
    reward stamped 9 s is read then: it was averaged in (0.5, counted nowhere) unless a step had
    taken a first (then late)."""
    j = joiner(aggregation="mean")
    j.add_interaction(make_interaction("a"), ts=0.0)
    j.add_reward(make_reward("a", 1.0), ts=1.0)
    j.add_interaction(make_interaction("x"), ts=12.0)
    taken = take_all(j) if step_first else []
    j.add_reward(make_reward("a", 0.0, source="judge"), ts=9.0)
    taken += take_all(j)
    assert [(t.interaction.interaction_id, t.reward) for t in taken] == [("a", 1.0)]
    assert j.counters.late_rewards == 1


def test_state_round_trip_through_json_continues_identically():
    def feed_first(j):
        j.add_interaction(make_interaction("a", turn_ends=(0,)), ts=0.0)
        j.add_interaction(make_interaction("b"), ts=1.0)
        j.add_reward(make_reward("a", 1.0, turns={0: 0.5}), ts=2.0)
        j.add_reward(make_reward("c", 4.0), ts=2.5)  # early
        j.add_interaction(make_interaction("d"), ts=3.0)
        j.add_reward(make_reward("d", 2.0), ts=3.0)
        j.pop_ready(max_rollouts=1, token_budget=100)  # takes a

    def feed_rest(j):
        j.add_reward(make_reward("a", 9.0), ts=4.0)  # late
        j.add_reward(make_reward("d", 3.0), ts=4.0)  # joins the ready d
        j.add_interaction(make_interaction("c"), ts=4.5)
        j.advance(20.0)  # b closes
        return [(x.interaction.interaction_id, x.reward, x.turn_rewards, x.rewarded) for x in take_all(j)]

    original = joiner(aggregation="mean", on_missing="default", default_value=0.25)
    feed_first(original)
    restored = joiner(aggregation="mean", on_missing="default", default_value=0.25)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.state_dict() == original.state_dict()
    assert feed_rest(restored) == feed_rest(original) == [("d", 2.5, {}, True), ("c", 4.0, {}, True),
                                                          ("b", 0.25, {}, False)]
    assert restored.counters == original.counters
    assert restored.counters.late_rewards == 1


def test_drop_stale_counts_and_later_rewards_are_late():
    j = joiner()
    for iid, version in (("old", 1), ("new", 4)):
        j.add_interaction(make_interaction(iid, version=version), ts=0.0)
        j.add_reward(make_reward(iid, 1.0), ts=0.0)
    assert j.drop_stale(min_version=3) == 1 and j.counters.stale == 1
    assert [x.interaction.interaction_id for x in take_all(j)] == ["new"]
    j.add_reward(make_reward("old", 1.0), ts=1.0)
    assert j.counters.late_rewards == 1


def train_once(j: RewardJoiner, iid: str, ts: float, created_at: float) -> list:
    j.add_interaction(make_interaction(iid, created_at=created_at), ts=ts)
    j.add_reward(make_reward(iid, 1.0), ts=ts)
    return take_all(j)


def test_a_copy_replayed_many_windows_later_is_still_recognised():
    j = joiner()  # memory_s: one day by default
    assert len(train_once(j, "a", ts=0.0, created_at=0.0)) == 1
    j.advance(500.0)  # 50 reward windows of other traffic
    assert train_once(j, "a", ts=1_000.0, created_at=0.0) == []  # the spool replayed it after a long outage
    assert j.counters.duplicate_interactions == 1


def test_a_copy_older_than_the_memory_is_refused_not_trained():
    j = joiner(memory_s=100.0)
    assert len(train_once(j, "a", ts=0.0, created_at=0.0)) == 1
    assert train_once(j, "a", ts=1_000.0, created_at=0.0) == []
    assert train_once(j, "b", ts=1_001.0, created_at=1.0) == []  # never seen, but it could be a copy: refused
    assert j.counters.expired_interactions == 2 and j.counters.duplicate_interactions == 0
    assert len(train_once(j, "c", ts=1_002.0, created_at=990.0)) == 1  # within the memory: trained


def test_a_full_memory_raises_its_floor_and_refuses_what_it_forgot():
    j = joiner(max_pending=2)
    for i, iid in enumerate(["a", "b", "c"]):
        assert len(train_once(j, iid, ts=float(i), created_at=float(i))) == 1
    assert j.memory.floor == 0.0 and "a" not in j.memory  # a was given up to hold c
    assert train_once(j, "a", ts=3.0, created_at=0.0) == []
    assert j.counters.expired_interactions == 1


def test_memory_must_cover_two_reward_windows():
    with pytest.raises(ValueError, match="two reward windows"):
        RewardConfig(window_s=60.0, memory_s=100.0)
    assert RewardConfig(window_s=60.0).id_memory_s == 86_400.0
    assert RewardConfig(window_s=100_000.0).id_memory_s == 200_000.0


def test_a_checkpoint_from_before_the_id_memory_loads():
    j = joiner()
    old = {"watermark": 5.0, "waiting": [], "ready": [], "held": [], "counters": {"interactions": 1},
           "finished": [["a", 25.0]]}  # remembered until ts + 2 windows: trained at ts 5
    j.load_state_dict(old)
    assert j.memory.get("a").anchor == 5.0 and j.memory.get("a").trained
    assert train_once(j, "a", ts=6.0, created_at=5.0) == [] and j.counters.duplicate_interactions == 1


@pytest.mark.parametrize("mode,expected", [("last", 0.0), ("sum", 1.0), ("mean", 0.5)])
def test_a_copy_of_a_reward_already_joined_is_ignored_and_counted(mode, expected):
    """User 1.0, judge 0.0, then the user's record read again (a spool replay, a producer's retry)."""
    j = joiner(aggregation=mode)
    j.add_interaction(make_interaction("a"), ts=0.0)
    user = Reward(interaction_id="a", value=1.0, source="user", created_at=5.0)
    j.add_reward(user, ts=1.0)
    j.add_reward(Reward(interaction_id="a", value=0.0, source="judge", created_at=6.0), ts=2.0)
    j.add_reward(user.model_copy(), ts=3.0)
    (joined,) = take_all(j)
    assert joined.reward == expected
    assert (j.counters.rewards, j.counters.duplicate_rewards) == (3, 1)


def test_two_rewards_alike_but_for_their_time_both_count():
    j = joiner(aggregation="sum")
    j.add_interaction(make_interaction("a"), ts=0.0)
    for created in (5.0, 5.000001):  # two thumbs-up a microsecond apart
        j.add_reward(Reward(interaction_id="a", value=1.0, created_at=created), ts=1.0)
    assert [x.reward for x in take_all(j)] == [2.0] and j.counters.duplicate_rewards == 0


def test_a_copy_of_a_held_reward_and_of_one_in_a_checkpoint_is_ignored():
    reward = Reward(interaction_id="a", value=1.0, created_at=5.0)
    j = joiner(aggregation="sum")
    j.add_reward(reward, ts=0.5)  # before its interaction: held
    j.add_reward(reward, ts=0.6)
    restored = joiner(aggregation="sum")
    restored.load_state_dict(json.loads(json.dumps(j.state_dict())))
    restored.add_reward(reward, ts=0.7)
    restored.add_interaction(make_interaction("a"), ts=1.0)
    assert [x.reward for x in take_all(restored)] == [1.0] and restored.counters.duplicate_rewards == 2


def test_one_interactions_rewards_are_capped_held_or_joined():
    """6000 distinct rewards for one id were all held, each add scanning the ones before it."""
    from trainer.join import MAX_REWARDS_PER_INTERACTION as CAP  # 64

    j = joiner(aggregation="mean")
    for k in range(CAP + 10):  # before the interaction: held (distinct values: no copies)
        j.add_reward(make_reward("early", k * 1e-3), ts=1.0)
    assert j.counters.early_rewards == CAP and j.counters.excess_rewards == 10
    j.add_interaction(make_interaction("early"), ts=1.0)  # joins the 64 held: 0, 0.001, ..., 0.063
    j.add_interaction(make_interaction("waiting"), ts=1.0)
    j.add_reward(make_reward("waiting", 1.0), ts=2.0)  # ready; rewards still join it within the window
    for k in range(CAP + 5):
        j.add_reward(make_reward("waiting", 0.5 + k * 1e-3), ts=2.0)
    assert j.counters.excess_rewards == 10 + 6  # 1.0 and 63 of the 69 after it joined
    taken = {t.interaction.interaction_id: t.reward for t in take_all(j)}
    assert taken["early"] == pytest.approx(0.0315)  # (0 + 63) / 2 * 0.001
    assert taken["waiting"] == pytest.approx((1.0 + 63 * 0.5 + 1e-3 * (62 * 63 / 2)) / 64)


def test_the_deadline_heap_does_not_keep_every_closed_window():
    from trainer.join import DEADLINE_SLACK

    j = RewardJoiner(RewardConfig(window_s=86_400.0), max_pending=100)
    for i in range(5_000):  # each waits, then its reward makes it ready: its deadline is stale
        j.add_interaction(make_interaction(f"i{i}"), ts=float(i))
        j.add_reward(make_reward(f"i{i}", 1.0), ts=float(i))
        j.pop_ready(10, 10**6)
    assert j.num_waiting == 0 and len(j._deadlines) <= DEADLINE_SLACK + 1


def test_a_full_id_memory_of_a_fast_clocks_ids_refuses_no_fresh_interaction():
    """A serving clock 30 minutes fast (its records read at the learner's time, their created_at ahead) and the
    id memory at capacity: every interaction still trains. Ids remembered under their created_at (tried on
    2026-12-07, reverted) raised the floor on overflow past every fresh record, which was then refused."""
    j = joiner(max_pending=5)  # the id memory's capacity, standing for trainer.join_max_pending
    trained = 0
    for i in range(20):
        t = float(i)
        j.add_interaction(make_interaction(f"i{i}", created_at=t + 1800.0), ts=t)
        j.add_reward(make_reward(f"i{i}", 1.0), ts=t)
        trained += len(j.pop_ready(max_rollouts=1000, token_budget=10**9))
    assert trained == 20 and j.counters.expired_interactions == 0


def test_a_ready_interaction_without_action_tokens_is_no_unit_of_a_step():
    """One that trains nothing (no action token left to train) counted as a unit: a step of two ranks
    took it and one usable rollout, had one rollout for two ranks, and dropped the usable one with it
    (trainer/feed.py). Taken with the units beside it, it is left out there."""
    j = joiner()
    j.add_interaction(make_interaction("nothing", response=(3,), mask=(False,)), ts=0.0)
    j.add_interaction(make_interaction("a"), ts=0.0)
    for iid in ("nothing", "a"):
        j.add_reward(make_reward(iid, 1.0), ts=1.0)
    assert j.ready_counts() == (1, 2, 3) and j.ready_units() == 1
    j.add_interaction(make_interaction("b"), ts=2.0)
    j.add_reward(make_reward("b", 1.0), ts=2.0)
    taken = j.pop_ready(max_rollouts=1, token_budget=10**9, min_units=2)
    assert [joined.interaction.interaction_id for joined in taken] == ["nothing", "a", "b"]


def test_a_continuation_whose_earlier_turn_was_rated_is_not_marked_defaulted():
    """The user rated q, then went on with d, which no one rated: under on_missing default d's own reward
    is the default, but its trajectory holds q's real 1.0, so its rollout is no reward outage's and the
    drift detector must see it (marked defaulted, it was left out)."""
    joiner = RewardJoiner(RewardConfig(window_s=10.0, on_missing="default", default_value=0.0), max_pending=100)
    q, d = conversation(["q", "d"])
    joiner.add_interaction(q, ts=101.0)
    joiner.add_interaction(d, ts=102.0)
    joiner.add_reward(make_reward("q", 1.0), ts=103.0)
    joiner.advance(200.0)
    (joined,) = joiner.pop_ready(max_rollouts=1000, token_budget=10**9)
    rollout = joined.to_rollout()
    assert rollout.total_reward == 1.0 and not rollout.defaulted
    alone = RewardJoiner(RewardConfig(window_s=10.0, on_missing="default", default_value=0.0), max_pending=100)
    alone.add_interaction(make_interaction("unrated"), ts=101.0)
    alone.advance(200.0)
    (unrated,) = alone.pop_ready(max_rollouts=1000, token_budget=10**9)
    assert unrated.to_rollout().defaulted
