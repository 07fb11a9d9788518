"""Multi-turn conversations in the join: every sampled turn trained once, rewards on their turns."""

from __future__ import annotations

from collections import Counter

import pytest

from online_sao.config import RewardConfig
from tests.trainer.records import conversation, make_interaction, make_reward, parent_ready_beside_its_continuation
from trainer.join import RewardJoiner

WINDOW_S = 10.0


def joiner(**kw) -> RewardJoiner:
    return RewardJoiner(RewardConfig(window_s=WINDOW_S, **kw), max_pending=100)


def take_all(j: RewardJoiner, group_size: int = 1):
    return j.pop_ready(max_rollouts=1000, token_budget=10**9, group_size=group_size)


def trained_tokens(taken) -> Counter:
    """How often each sampled token id was an action of a taken rollout (conversation() gives
    every sampled token its own id)."""
    counts: Counter = Counter()
    for joined in taken:
        rollout = joined.to_rollout()
        counts.update(t for t, is_action in zip(rollout.token_ids, rollout.action_mask) if is_action)
    return counts


def rewards_by_token(joined) -> dict[int, float]:
    rollout = joined.to_rollout()
    return {rollout.token_ids[i]: v for i, v in rollout.rewards.items()}


def test_a_client_rating_every_message_trains_each_turn_once():
    p, c, d = conversation(["p", "c", "d"])
    j, taken = joiner(), []
    for ts, (record, value) in enumerate([(p, 1.0), (c, 0.5), (d, -1.0)]):
        j.add_interaction(record, ts=3.0 * ts)
        j.add_reward(make_reward(record.interaction_id, value), ts=3.0 * ts + 1)
        taken += take_all(j)  # the learner takes each rated turn before the next one arrives
    assert [x.interaction.interaction_id for x in taken] == ["p", "c", "d"]
    assert trained_tokens(taken) == Counter({100: 1, 101: 1, 200: 1, 201: 1, 300: 1, 301: 1})
    assert taken[1].observed_turns == {0} and taken[2].observed_turns == {0, 1}
    assert [x.num_action_tokens for x in taken] == [2, 2, 2]
    assert rewards_by_token(taken[2]) == {301: -1.0}  # each rollout its own reward, on its own last token


def test_with_default_rewards_a_continuation_supersedes_its_waiting_parent():
    p, c = conversation(["p", "c"])
    j = joiner(on_missing="default", default_value=0.0)
    j.add_interaction(p, ts=0.0)
    j.add_interaction(c, ts=5.0)  # the user answered: p's window is still open
    j.add_reward(make_reward("c", 2.0), ts=6.0)
    j.advance(100.0)  # every window closed: p must not train again on its own with the default reward
    taken = take_all(j)
    assert [x.interaction.interaction_id for x in taken] == ["c"]
    assert trained_tokens(taken) == Counter({100: 1, 101: 1, 200: 1, 201: 1})
    assert j.counters.superseded == 1 and j.counters.defaulted == 0


def test_a_reward_for_an_absorbed_parent_lands_on_its_turn_and_waits_for_the_continuations_own():
    p, c = conversation(["p", "c"])
    j = joiner(aggregation="sum")
    j.add_interaction(p, ts=0.0)
    j.add_interaction(c, ts=1.0)
    j.add_reward(make_reward("p", 0.75), ts=2.0)  # rated after the conversation went on
    assert j.ready_stats() == (0, 0)  # c is ready on a reward for its own id only
    j.add_reward(make_reward("c", 1.0, turns={0: 0.5}), ts=3.0)
    (joined,) = take_all(j)
    assert rewards_by_token(joined) == {101: 0.75 + 0.5, 201: 1.0}  # p's last token: its final + turn 0's


def test_a_continuation_with_only_its_parents_reward_trains_when_its_window_closes():
    p, c = conversation(["p", "c"])
    j = joiner(on_missing="drop")
    j.add_interaction(p, ts=0.0)
    j.add_reward(make_reward("p", 1.0), ts=0.5)  # p is ready (rated) ...
    j.add_interaction(c, ts=1.0)  # ... so it stays ready and trains alone
    (alone,) = take_all(j)
    assert alone.interaction.interaction_id == "p"
    j.advance(100.0)  # c never rated: dropped
    assert take_all(j) == [] and j.counters.dropped_no_reward == 1

    q, d = conversation(["q", "d"])
    j.add_interaction(q, ts=101.0)
    j.add_interaction(d, ts=102.0)
    j.add_reward(make_reward("q", 1.0), ts=103.0)  # only the absorbed parent was rated
    j.advance(200.0)
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "d" and joined.reward is None
    assert rewards_by_token(joined) == {101: 1.0} and trained_tokens([joined]) == Counter({100: 1, 101: 1,
                                                                                            200: 1, 201: 1})


def test_a_continuation_read_before_its_parent_absorbs_it_when_it_comes():
    p, c = conversation(["p", "c"])
    j = joiner()
    j.add_reward(make_reward("p", 0.25), ts=0.0)  # another partition: p's reward and c come first
    j.add_interaction(c, ts=1.0)
    j.add_interaction(p, ts=2.0)
    j.add_reward(make_reward("c", 1.0), ts=3.0)
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "c" and rewards_by_token(joined) == {101: 0.25, 201: 1.0}
    assert j.counters.superseded == 1 and j.counters.duplicate_interactions == 0
    j.add_interaction(p, ts=4.0)  # a replayed copy of p
    assert j.counters.duplicate_interactions == 1 and take_all(j) == []


def test_a_parent_read_after_its_trained_continuation_trains_nothing():
    p, c = conversation(["p", "c"])
    j = joiner()
    j.add_interaction(c, ts=0.0)
    j.add_reward(make_reward("c", 1.0), ts=0.5)
    first = take_all(j)
    j.add_interaction(p, ts=1.0)
    j.add_reward(make_reward("p", 1.0), ts=1.5)
    assert take_all(j) == [] and trained_tokens(first) == Counter({100: 1, 101: 1, 200: 1, 201: 1})
    assert j.counters.superseded == 1 and j.counters.late_rewards == 1


def test_two_continuations_of_one_parent_train_its_turn_once():
    p, c1 = conversation(["p", "c1"])
    _, c2 = conversation(["p", "c2"])  # a regenerated answer: same parent, another continuation
    j = joiner()
    j.add_interaction(p, ts=0.0)
    j.add_interaction(c1, ts=1.0)
    j.add_interaction(c2, ts=2.0)
    j.add_reward(make_reward("c2", 1.0), ts=3.0)
    j.add_reward(make_reward("c1", 1.0), ts=4.0)
    taken = take_all(j)
    assert [x.interaction.interaction_id for x in taken] == ["c2", "c1"]
    assert trained_tokens(taken) == Counter({100: 1, 101: 1, 200: 2, 201: 2})  # c1's and c2's turns share ids
    assert taken[1].observed_turns == {0}


def test_a_parents_reward_trains_with_its_turn_in_whichever_branch_is_taken_first():
    """c1 is read first and claims p; c2 (a regenerated answer to the same turn) is rated first.
    c2 trains p's turn, so p's reward, joined to c1, moves with it: left on c1 it fell on a turn
    trained already and was lost (found by test_join_trajectories_properties.py)."""
    p, c1 = conversation(["p", "c1"])
    _, c2 = conversation(["p", "c2"])
    j = joiner()
    j.add_interaction(c1, ts=0.0)  # p not read yet: c1 claims it
    j.add_interaction(c2, ts=0.5)
    j.add_interaction(p, ts=1.0)
    j.add_reward(make_reward("p", 0.25), ts=1.5)  # routed to p's claimer, c1
    j.add_reward(make_reward("c2", 1.0), ts=2.0)
    (first,) = take_all(j)
    assert first.interaction.interaction_id == "c2" and first.observed_turns == frozenset()
    assert rewards_by_token(first) == {101: 0.25, 201: 1.0}
    j.add_reward(make_reward("c1", 0.5), ts=3.0)
    (second,) = take_all(j)
    assert second.interaction.interaction_id == "c1" and second.observed_turns == {0}
    assert rewards_by_token(second) == {201: 0.5}
    assert (j.counters.trained_turn_rewards, j.counters.late_rewards) == (0, 0)
    j.add_reward(make_reward("p", 1.0), ts=4.0)  # p trained: late
    assert j.counters.late_rewards == 1


@pytest.mark.parametrize("held", [False, True])
def test_a_reward_rating_a_turn_the_answer_does_not_have_is_counted_and_the_answer_still_trains(held):
    """A judge writing to the topic (serving checks feedback only while it holds the trajectory)
    rates turn 1 of a one-turn answer: applied, it made the rollout unbuildable (RolloutError) and
    lost the answer's good reward with it (found by test_join_trajectories_properties.py)."""
    j = joiner()
    bad, good = make_reward("a", 0.5, turns={1: 1.0}), make_reward("a", 0.25)
    if held:  # read before the interaction
        j.add_reward(bad, ts=0.0)
    j.add_interaction(make_interaction("a", turn_ends=[2]), ts=0.5)
    if not held:
        j.add_reward(bad, ts=1.0)
    assert j.num_waiting == 1 and j.counters.misdirected_rewards == 1
    j.add_reward(good, ts=1.5)
    (joined,) = take_all(j)
    assert joined.reward == 0.25 and joined.turn_rewards == {}
    assert joined.to_rollout().rewards == {5: 0.25}  # prompt of 3, the answer's last token


def test_a_turn_reward_for_a_turn_trained_earlier_is_counted_not_applied():
    p, c = conversation(["p", "c"])
    j = joiner()
    j.add_interaction(p, ts=0.0)
    j.add_reward(make_reward("p", 1.0), ts=0.5)
    take_all(j)
    j.add_interaction(c, ts=1.0)
    j.add_reward(make_reward("c", 1.0, turns={0: 3.0, 1: 0.5}), ts=1.5)
    (joined,) = take_all(j)
    assert rewards_by_token(joined) == {201: 1.5} and j.counters.trained_turn_rewards == 1


def test_each_reward_rating_a_turn_trained_earlier_is_counted():
    """Two sources rate c's first turn, trained earlier with p: two values not applied, two counted
    (counted once per turn before, under-reporting what was lost)."""
    p, c = conversation(["p", "c"])
    j = joiner(aggregation="mean")
    j.add_interaction(p, ts=0.0)
    j.add_reward(make_reward("p", 1.0), ts=0.5)
    take_all(j)
    j.add_interaction(c, ts=1.0)
    j.add_reward(make_reward("c", 1.0, turns={0: 3.0}, source="user"), ts=1.5)
    j.add_reward(make_reward("c", 0.0, turns={0: 2.0, 1: 0.25}, source="judge"), ts=1.6)
    (joined,) = take_all(j)
    assert rewards_by_token(joined) == {201: 0.5 + 0.25} and j.counters.trained_turn_rewards == 2


def test_trajectory_state_round_trips_through_json():
    import json

    p, c, d = conversation(["p", "c", "d"])
    original = joiner()
    original.add_interaction(d, ts=0.0)  # claims p and c before they are read
    original.add_interaction(p, ts=1.0)
    restored = joiner()
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.state_dict() == original.state_dict()
    for j in (original, restored):
        j.add_interaction(c, ts=2.0)
        j.add_reward(make_reward("c", 0.5), ts=2.5)
        j.add_reward(make_reward("d", 1.0), ts=3.0)
    assert [rewards_by_token(x) for x in take_all(restored)] == [rewards_by_token(x) for x in take_all(original)]
    assert restored.counters == original.counters and original.counters.superseded == 2


@pytest.mark.parametrize("max_pending", [3, 1000])
def test_a_turn_the_id_memory_forgot_is_not_trained_again_in_a_continuation(max_pending):
    """A trained, then five other interactions finished: with room for 3 ids the memory forgot A,
    and C, continuing A 10 s later, trained A's turn a second time (nothing counted)."""
    t = 1000.0
    a, c = conversation(["A", "C"])  # serving's TrajectoryPrefix dates the trajectory by its first turn
    assert (a.trajectory_started_at, c.trajectory_started_at) == (None, a.created_at)
    a = a.model_copy(update={"created_at": t})
    c = c.model_copy(update={"created_at": t + 10, "trajectory_started_at": t})
    j = RewardJoiner(RewardConfig(), max_pending=max_pending)
    j.add_interaction(a, t)
    j.add_reward(make_reward("A", 1.0), t + 1)
    assert [x.interaction.interaction_id for x in j.pop_ready(32, 10**9)] == ["A"]
    for k in range(5):
        j.add_interaction(make_interaction(f"o{k}", created_at=t + 2 + k), t + 2 + k)
        j.add_reward(make_reward(f"o{k}", 0.0), t + 2 + k)
        j.pop_ready(32, 10**9)
    j.add_interaction(c, t + 10)
    j.add_reward(make_reward("C", 1.0), t + 11)
    [joined] = j.pop_ready(32, 10**9)
    assert joined.observed_turns == frozenset({0})  # A's turn: an observation either way
    assert j.counters.forgotten_turns == (1 if max_pending == 3 else 0)


def test_a_turn_the_id_memory_forgot_is_not_trained_again_when_the_servers_clock_runs_fast():
    """A server 600 s fast: the feed reads its records at most 60 s ahead of the learner, so the memory
    anchors A at its record time 1060, 540 s before its created_at 1600. Once the floor (1070) passed
    A's anchor but not its created_at (C's trajectory_started_at), C claimed A's turn and trained it
    a second time (nothing counted)."""
    a, c = conversation(["A", "C"])
    a = a.model_copy(update={"created_at": 1600.0})
    c = c.model_copy(update={"created_at": 1630.0, "trajectory_started_at": 1600.0})
    j = RewardJoiner(RewardConfig(window_s=WINDOW_S, memory_s=20.0), max_pending=100)
    j.add_interaction(a, ts=1060.0)
    j.add_reward(make_reward("A", 1.0), ts=1061.0)
    assert [x.interaction.interaction_id for x in take_all(j)] == ["A"]
    j.advance(1090.0)  # the memory's floor: 1090 - 20 = 1070
    assert "A" not in j.memory
    j.add_interaction(c, ts=1090.0)  # C's anchor, 1090, lies 540 s before its created_at too
    j.add_reward(make_reward("C", 1.0), ts=1091.0)
    [joined] = take_all(j)
    assert joined.observed_turns == frozenset({0}) and j.counters.forgotten_turns == 1


def test_a_reward_for_an_absorbed_parent_read_after_the_continuations_window_closed_is_late():
    """p absorbed by c; c's window (ends at 11 s) closed with no reward of its own: c waits for a step
    with the default. p's reward, stamped at 5 s but read with the clock at 12 s, landed on p's turn."""
    p, c = conversation(["p", "c"])
    j = joiner(on_missing="default", default_value=-1.0)
    j.add_interaction(p, ts=0.0)
    j.add_interaction(c, ts=1.0)
    j.add_interaction(make_interaction("x"), ts=12.0)
    j.add_reward(make_reward("p", 0.5), ts=5.0)
    (joined,) = take_all(j)
    assert rewards_by_token(joined) == {201: -1.0}  # the default on c's last token; none on p's (101)
    assert (j.counters.late_rewards, j.counters.defaulted) == (1, 1)


def test_copies_of_an_ancestor_a_continuation_absorbed_count_as_duplicates():
    """Books only (nothing trained twice either way): they were counted as superseded again."""
    a, c = conversation(["A", "C"])
    j = RewardJoiner(RewardConfig())
    j.add_interaction(a, 1000.0)
    j.add_interaction(c, 1001.0)  # A, waiting, is absorbed
    assert (j.counters.superseded, j.counters.duplicate_interactions) == (1, 0)
    j.add_interaction(a, 1002.0)
    j.add_interaction(a, 1003.0)
    assert (j.counters.superseded, j.counters.duplicate_interactions) == (1, 2)


def test_the_token_budget_counts_only_the_turns_a_continuation_trains():
    """A continuation carries its trained parent's action tokens as observations: they are not
    trained again, so they count neither towards readiness nor against a step's token budget."""
    p, c, d = conversation(["p", "c", "d"])
    j = joiner()
    j.add_interaction(p, ts=0.0)
    j.add_reward(make_reward("p", 1.0), ts=1.0)
    take_all(j)
    j.add_interaction(c, ts=2.0)
    j.add_reward(make_reward("c", 1.0), ts=3.0)
    j.add_interaction(d, ts=4.0)
    j.add_reward(make_reward("d", 1.0), ts=5.0)
    # c trains its own 2 tokens (p's are observations); d is its own continuation and trains 2 more
    # once c is taken: its 4 earlier action tokens are observations then.
    assert j.ready_stats() == (2, 2 + 2)
    taken = j.pop_ready(max_rollouts=10, token_budget=3)  # c's 2 tokens leave room under the budget
    assert [x.interaction.interaction_id for x in taken] == ["c", "d"]
    assert [x.num_action_tokens for x in taken] == [2, 2]


def test_a_ready_parent_absorbed_by_a_ready_continuation_is_not_counted_as_ready():
    """ready_stats counted p and c2 (2 rollouts, 6 tokens) where pop_ready hands out c2 alone, which
    trains p's turn (found by test_join_trajectories_properties.py)."""
    j = parent_ready_beside_its_continuation(RewardConfig(window_s=WINDOW_S, on_missing="drop"))
    assert j.ready_stats() == (1, 4) and j.ready_units() == 1 and j.ready_rollouts() == 1
    (joined,) = take_all(j)
    assert joined.interaction.interaction_id == "c2" and rewards_by_token(joined) == {101: 0.25, 201: 1.0}
    assert j.ready_stats() == (0, 0)
