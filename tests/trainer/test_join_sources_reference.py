"""The reward join with several sources against a plain reference of its rules, on random
single-turn traffic: rewards before and after their interaction, from trusted, awaited and other
sources, windows closing, steps taking what is ready."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from online_sao.config import RewardConfig
from tests.trainer.records import make_interaction, make_reward
from trainer.join import RewardJoiner

WINDOW_S = 10.0
IDS = [f"i{k}" for k in range(5)]
SOURCES = ["judge", "user", "scraper"]


@dataclass
class Expected:
    """One interaction as the reference sees it."""

    state: str = "unseen"  # unseen -> waiting -> ready -> taken, or closed (its window ended unrated)
    arrived: float = 0.0
    values: list[float] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)


class Reference:
    """The documented rules, one interaction at a time (docs/ALGORITHM.md, trainer/join.py)."""

    def __init__(self, trusted: list[str], awaited: list[str]):
        self.trusted, self.awaited = trusted, awaited
        self.items = {iid: Expected() for iid in IDS}
        self.held: dict[str, list[tuple[float, str, float]]] = {iid: [] for iid in IDS}
        self.missing_sources = self.ignored = self.late = 0

    def rated(self, e: Expected) -> bool:
        return bool(e.values) and e.sources.issuperset(self.awaited)

    def advance(self, now: float) -> None:
        for iid, e in self.items.items():
            if e.state == "waiting" and e.arrived + WINDOW_S < now:
                if e.values:
                    e.state, self.missing_sources = "ready", self.missing_sources + 1
                else:
                    e.state = "closed"
            self.held[iid] = [h for h in self.held[iid] if h[0] + WINDOW_S >= now]

    def interaction(self, iid: str, now: float) -> None:
        self.advance(now)
        e = self.items[iid]
        e.state, e.arrived = "waiting", now
        for _, source, value in self.held[iid]:
            e.values.append(value)
            e.sources.add(source)
        self.held[iid] = []
        if self.rated(e):
            e.state = "ready"

    def reward(self, iid: str, source: str, value: float, now: float) -> None:
        self.advance(now)
        if source not in self.trusted:
            self.ignored += 1
            return
        e = self.items[iid]
        if e.state == "unseen":
            self.held[iid].append((now, source, value))
        elif e.state in ("taken", "closed") or now > e.arrived + WINDOW_S:
            self.late += 1
        else:
            e.values.append(value)
            e.sources.add(source)
            if e.state == "waiting" and self.rated(e):
                e.state = "ready"

    def take(self) -> dict[str, float]:
        taken = {iid: mean(e.values) for iid, e in self.items.items() if e.state == "ready"}
        for iid in taken:
            self.items[iid].state = "taken"
        return taken


event = st.one_of(
    st.tuples(st.just("interaction"), st.sampled_from(IDS)),
    st.tuples(st.just("reward"), st.sampled_from(IDS), st.sampled_from(SOURCES)),
    st.tuples(st.just("take")),
)
# time moves by 0 to 6 s between events, so windows of 10 s close now and then
traffic = st.lists(st.tuples(event, st.integers(0, 6)), min_size=1, max_size=40)


@pytest.mark.parametrize("awaited", [[], ["judge"], ["judge", "user"]])
@settings(max_examples=1000, deadline=None)
@given(events=traffic)
def test_the_join_follows_the_reference_on_random_traffic(awaited, events):
    trusted = ["judge", "user"]
    join = RewardJoiner(RewardConfig(window_s=WINDOW_S, aggregation="mean", sources=trusted,
                                     wait_for_sources=awaited), max_pending=1000)
    ref = Reference(trusted, awaited)
    now, seen, value = 0.0, set(), 0.0
    for ev, dt in [*events, (("end",), 20)]:
        now += dt
        kind = ev[0]
        if kind == "interaction":
            if ev[1] in seen:
                continue  # a copy: the join ignores it (tested elsewhere); the reference has no such rule
            seen.add(ev[1])
            join.add_interaction(make_interaction(ev[1]), ts=now)
            ref.interaction(ev[1], now)
        elif kind == "reward":
            value += 1.0  # every reward distinct: no copies
            join.add_reward(make_reward(ev[1], value, source=ev[2]), ts=now)
            ref.reward(ev[1], ev[2], value, now)
        else:  # a step takes what is ready; "end" first lets every window close
            if kind == "end":
                join.advance(now)
                ref.advance(now)
            got = {j.interaction.interaction_id: j.reward for j in join.pop_ready(10**6, 10**9)}
            assert got == pytest.approx(ref.take()), events
    assert (join.counters.missing_sources, join.counters.ignored_rewards) == (ref.missing_sources, ref.ignored)
    assert join.counters.late_rewards == ref.late
