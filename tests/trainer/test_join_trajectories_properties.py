"""The reward join on random multi-turn traffic (hypothesis): conversations that branch, records
and rewards read in any order, copies read twice, steps and checkpoint restores anywhere. Whatever
the order, the join's promises hold:

- every turn of every conversation trains exactly once (trainer/join_trajectories.py: "each turn
  is trained once"; with ``on_missing: default`` no interaction is dropped for want of a reward),
  but for an answer cut short, which trains only inside a continuation that carries it;
- every reward record is applied at most once, and one not applied is counted as such (late,
  expired, misdirected or on a turn trained earlier): none is lost without a count;
- a reward is applied only to the answer it names: its value lands on that interaction's own
  reward or on that interaction's last turn in a continuation.

Each reward's value is a distinct power of two and the aggregation is ``sum``, so the reward on a
trained turn says exactly which records were applied to it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from online_sao.config import RewardConfig
from online_sao.schemas import ABORTED, Interaction, Reward, SamplingParams, TurnReward
from serving.trajectories import TrajectoryPrefix
from trainer.join import RewardJoiner
from trainer.join_state import JoinedInteraction, last_turns

WINDOW_S = 10.0
CONFIG = RewardConfig(window_s=WINDOW_S, aggregation="sum", on_missing="default", default_value=0.0,
                      min_value=-1e6, max_value=1e6)
DROPPING = CONFIG.model_copy(update={"on_missing": "drop"})
WAITING = CONFIG.model_copy(update={"sources": ["judge", "user"], "wait_for_sources": ["judge", "user"]})
SOURCES = ["judge", "user", "scraper"]
MAX_REWARDS = 8
"""Reward record k has the value 2^k and, if it rates a turn, 2^(8 + k) on that turn: sums of
distinct ones stay exact and within ``max_value``."""
TURN_BIT = MAX_REWARDS


@dataclass(frozen=True)
class Event:
    kind: str  # "interaction", "reward", "step", "restore"
    index: int = 0
    ts: float = 0.0
    take: int = 0


def build_records(parents: list[int | None], created: list[float], cut: frozenset[int] = frozenset()) -> list[Interaction]:
    """One record per node, built as serving builds them: a node continues its parent's record
    (so a parent with two children is a conversation that branches); the nodes in ``cut`` are
    answers cut short (``finish_reason`` abort)."""
    records: list[Interaction] = []
    for k, (parent, at) in enumerate(zip(parents, created)):
        prefix = TrajectoryPrefix([5, 6]) if parent is None else TrajectoryPrefix.continuing(records[parent], [3])
        fields = prefix.extended(f"n{k}", SamplingParams(), [100 + k, 200 + k], [-0.5, -0.5], [0, 0])
        if prefix.started_at is not None:  # the trajectory's start on the scenario's clock, not serving's
            fields["trajectory_started_at"] = created[_root(parents, k)]
        records.append(Interaction(interaction_id=f"n{k}", model="tiny", created_at=at, completed_at=at,
                                   finish_reason=ABORTED if k in cut else "stop", **fields))
    return records


def _root(parents: list[int | None], k: int) -> int:
    while parents[k] is not None:
        k = parents[k]
    return k


@dataclass(frozen=True)
class Scenario:
    parents: list[int | None]
    created: list[float]
    rewards: list[tuple[int, float, int | None, str]]
    """(the node rated, its delay after the node's creation, the turn it rates or None, its source)
    per record."""
    order: list[Event]
    cut: frozenset[int]

    def records(self) -> list[Interaction]:
        return build_records(self.parents, self.created, self.cut)

    def trains(self, k: int) -> bool:
        """Whether node k's turn must train (exactly once, when nothing is dropped): a cut answer
        does not train alone, only inside a continuation that carries it."""
        return k not in self.cut or any(self.descends(j, k) for j in range(len(self.parents)))

    def descends(self, j: int, k: int) -> bool:
        while (j := self.parents[j]) is not None:
            if j == k:
                return True
        return False


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 6))
    parents: list[int | None] = [None]
    for k in range(1, n):
        parents.append(draw(st.one_of(st.none(), st.integers(0, k - 1))))
    created: list[float] = []
    for k, parent in enumerate(parents):
        base = draw(st.floats(0, 20)) if parent is None else created[parent]
        created.append(base + (0.0 if parent is None else draw(st.floats(0.5, 8))))
    turns = st.one_of(st.none(), st.integers(0, 3)) if draw(st.booleans()) else st.none()  # turn ratings or none
    rewards = draw(st.lists(st.tuples(st.integers(0, n - 1), st.floats(0, 1.5 * WINDOW_S), turns,
                                      st.sampled_from(SOURCES)), max_size=MAX_REWARDS))
    events = [Event("interaction", k, created[k]) for k in range(n)]
    events += [Event("interaction", k, created[k]) for k in draw(st.lists(st.integers(0, n - 1), max_size=2))]  # copies
    events += [Event("reward", r, created[node] + delay) for r, (node, delay, _, _) in enumerate(rewards)]
    events += [Event("reward", r, created[rewards[r][0]] + rewards[r][1])  # a reward read twice
               for r in draw(st.lists(st.integers(0, max(len(rewards) - 1, 0)), max_size=2)) if rewards]
    events += [Event("step", take=draw(st.integers(1, 3))) for _ in range(draw(st.integers(0, 4)))]
    events += [Event("restore") for _ in range(draw(st.integers(0, 2)))]
    order = draw(st.permutations(events))
    cut = frozenset(draw(st.lists(st.integers(0, n - 1), max_size=1)))  # an answer cut short, at times
    return Scenario(parents, created, rewards, order, cut)


def restored(joiner: RewardJoiner) -> RewardJoiner:
    """A learner restarted from a checkpoint of ``joiner`` (through JSON, as the checkpoint is written)."""
    again = RewardJoiner(joiner.cfg, joiner.max_pending)
    again.load_state_dict(json.loads(json.dumps(joiner.state_dict())))
    return again


def powers(value: float) -> set[int]:
    """The bits of ``value``, a sum of distinct powers of two: k for record k's value, TURN_BIT + k
    for its turn reward."""
    whole = int(value)
    assert whole == value and whole >= 0, f"a trained reward {value} that is no sum of distinct records"
    return {bit for bit in range(2 * MAX_REWARDS) if whole >> bit & 1}


def reward_record(rewards, event: Event) -> Reward:
    node, _, turn, source = rewards[event.index]
    turns = [] if turn is None else [TurnReward(turn=turn, value=float(2 ** (TURN_BIT + event.index)))]
    return Reward(interaction_id=f"n{node}", value=float(2 ** event.index), turn_rewards=turns, created_at=event.ts,
                  source=source)


def run(scenario, cfg: RewardConfig, max_pending: int = 100) -> tuple[RewardJoiner, list[JoinedInteraction]]:
    """The scenario's records through a joiner, then every window closed and everything taken."""
    rewards = scenario.rewards
    records = scenario.records()
    joiner = RewardJoiner(cfg, max_pending)
    taken: list[JoinedInteraction] = []
    for event in scenario.order:
        if event.kind == "interaction":
            joiner.add_interaction(records[event.index], event.ts)
        elif event.kind == "reward":
            joiner.add_reward(reward_record(rewards, event), event.ts)
        elif event.kind == "step":
            taken += joiner.pop_ready(max_rollouts=event.take, token_budget=10 ** 6)
        else:
            joiner = restored(joiner)
    joiner.advance(max(scenario.created) + 10 * WINDOW_S)  # every window closes
    ready_rollouts, ready_tokens = joiner.ready_stats()
    batch = joiner.pop_ready(max_rollouts=10 ** 6, token_budget=10 ** 6)
    tokens = sum(joined.num_action_tokens for joined in batch)  # what the step trains
    assert ready_rollouts == len(batch)
    # Exact, unless the id memory forgets during the pass: a forgotten ancestor's turn becomes an
    # observation then (JoinedInteraction), which the count ahead cannot know.
    assert ready_tokens == tokens if max_pending >= len(records) else ready_tokens >= tokens
    taken += batch
    return joiner, taken


def trained_turns(taken: list[JoinedInteraction]) -> Counter[str]:
    """How many times each interaction's own turn was trained (not an observation)."""
    return Counter(origin.interaction_id for joined in taken for turn, origin in enumerate(joined.interaction.origins())
                   if turn not in joined.observed_turns)


def applied_rewards(taken: list[JoinedInteraction], records: list[Interaction],
                    rewards) -> list[tuple[int, str]]:
    """(reward index, the interaction whose reward it became) for every reward record whose value
    was applied; asserts that a turn reward applied went to the turn its record names."""
    applied: list[tuple[int, str]] = []
    for joined in taken:
        own = joined.interaction.interaction_id
        assert all(0 <= turn < len(joined.interaction.turn_ends) for turn in joined.turn_rewards), \
            f"{own} was taken with a reward for a turn it does not have: it cannot be trained"
        if joined.reward is not None:
            applied += [(r, own) for r in powers(joined.reward)]
        at_turn = {turn: origin for origin, turn in last_turns(joined.interaction).items()}
        origins = joined.interaction.origins()
        for turn, value in joined.turn_rewards.items():
            for bit in powers(value):
                if bit < TURN_BIT:
                    assert turn in at_turn, f"a reward on turn {turn} of {own}, which ends no other interaction's turn"
                    applied.append((bit, at_turn[turn]))
                    continue
                node, _, named, _ = rewards[bit - TURN_BIT]
                assert named == turn, f"reward {bit - TURN_BIT} rated turn {named}, applied on turn {turn}"
                assert records[node].origins()[named] == origins[turn], "a turn reward on another answer's turn"
    return applied


def check_rewards(scenario, joiner: RewardJoiner, taken: list[JoinedInteraction]) -> None:
    """Each reward record applied at most once, to the answer it names (a turn rating to the turn it
    names); without turn ratings, one not applied is counted."""
    rewards, order = scenario.rewards, scenario.order
    applied = applied_rewards(taken, scenario.records(), rewards)
    indices = [r for r, _ in applied]
    assert len(indices) == len(set(indices)), "a reward applied twice"
    assert all(f"n{rewards[r][0]}" == target for r, target in applied), "a reward applied to another answer"
    if any(turn is not None for _, _, turn, _ in rewards):
        return  # a record may be applied in part (its turn rating on a turn trained earlier): counted per turn
    counters = joiner.counters
    not_applied = (counters.late_rewards + counters.expired_rewards + counters.misdirected_rewards
                   + counters.trained_turn_rewards + counters.excess_rewards + counters.duplicate_rewards
                   + counters.ignored_rewards)
    read = sum(1 for e in order if e.kind == "reward")  # copies too: each is applied or counted once
    assert read == len(applied) + not_applied, (
        f"{read} reward records read: {len(applied)} applied, {not_applied} counted as not applied ({counters})")


@settings(max_examples=1500, deadline=None)
@given(scenarios())
def test_every_turn_trains_once_and_every_reward_is_applied_once_or_counted(scenario):
    joiner, taken = run(scenario, CONFIG)
    assert trained_turns(taken) == Counter(f"n{k}" for k in range(len(scenario.parents)) if scenario.trains(k)), \
        "each turn trains exactly once"
    check_rewards(scenario, joiner, taken)


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_waiting_for_two_sources_of_three_every_turn_trains_once_and_no_reward_is_lost(scenario):
    joiner, taken = run(scenario, WAITING)
    assert trained_turns(taken) == Counter(f"n{k}" for k in range(len(scenario.parents)) if scenario.trains(k))
    check_rewards(scenario, joiner, taken)
    applied = {r for r, _ in applied_rewards(taken, scenario.records(), scenario.rewards)}
    assert all(scenario.rewards[r][3] != "scraper" for r in applied), "a source left out was applied"


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_dropping_unrewarded_answers_loses_no_reward_and_trains_no_turn_twice(scenario):
    joiner, taken = run(scenario, DROPPING)
    assert max(trained_turns(taken).values(), default=1) == 1, "a turn trained twice"
    check_rewards(scenario, joiner, taken)


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_with_a_full_buffer_and_a_forgetting_memory_no_turn_trains_twice(scenario):
    """Three items per kind: waiting answers and held rewards are evicted, the id memory forgets;
    the join then trains a turn at most once rather than exactly once, and a reward it applies still
    goes to the answer it names, once."""
    joiner, taken = run(scenario, CONFIG, max_pending=3)
    assert max(trained_turns(taken).values(), default=1) == 1, "a turn trained twice"
    rewards = scenario.rewards
    applied = applied_rewards(taken, scenario.records(), rewards)
    assert len({r for r, _ in applied}) == len(applied)
    assert all(f"n{rewards[r][0]}" == target for r, target in applied)
