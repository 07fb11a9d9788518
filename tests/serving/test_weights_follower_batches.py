"""The weights follower reads notices a poll at a time and loads only the one whose effect lasts
(serving/weights_follower.py). Its promises: that ends where reading them one by one would have
ended, also when some versions cannot be loaded and when an operator holds and releases; and once
every hold is released, the replica serves what it would have served had there been no hold
(serving/weights_hold.py). Checked on random notice streams as the learner and an operator write
them (hypothesis): publishes of ever newer versions, roll-backs to an older published one, holds of
a published one, releases; some versions' weights missing for good; the stream cut into polls at
random.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from online_sao.schemas import WeightsNotice
from serving.engine.base import SwapResult
from serving.weights_follower import WeightsFollower
from streams.memory import InMemoryBackend


class MissingWeights(FileNotFoundError):
    pass


class Store:
    """Weights of every version but the broken ones."""

    def __init__(self, broken: set[int]) -> None:
        self.broken = broken

    def load(self, location: str, checksum: str) -> dict:
        version = int(location.removeprefix("mem://"))
        if version in self.broken:
            raise MissingWeights(location)
        return {"version": version}


class Engine:
    """Serves one version; a swap to an older one needs ``force``, as the engines' contract says."""

    def __init__(self) -> None:
        self.policy_version = 0

    def swap_weights(self, version: int, state_dict: dict, force: bool = False) -> SwapResult:
        assert state_dict == {"version": version}
        if version <= self.policy_version and not force:
            return SwapResult(version, False, 0.0, 0.0, reason="older")
        self.policy_version = version
        return SwapResult(version, True, 0.0, 0.0)


def notice(action: str, version: int) -> WeightsNotice:
    return WeightsNotice(action=action, version=version, location=f"mem://{version}", checksum="0" * 64)


@st.composite
def streams(draw):
    """A notice stream, the versions that cannot be loaded, and where the polls end."""
    published: list[int] = []
    out: list[WeightsNotice] = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["publish", "publish", "publish", "rollback", "hold", "release"]))
        if kind == "publish" or not published:
            published.append(len(published) + 1)
            out.append(notice("publish", published[-1]))
        elif kind == "release":
            held = [m.version for m in out if m.action == "hold"]
            out.append(notice("release", draw(st.sampled_from([held[-1]] * 3 + published) if held else
                                               st.sampled_from(published))))
        else:
            out.append(notice(kind, draw(st.sampled_from(published))))
    broken = draw(st.sets(st.sampled_from(published), max_size=len(published)))
    cuts = sorted(draw(st.sets(st.integers(1, max(len(out) - 1, 1)), max_size=len(out))))
    return out, broken, cuts


def follow(polls: list[list[WeightsNotice]], broken: set[int]) -> Engine:
    engine = Engine()
    follower = WeightsFollower(InMemoryBackend(), "weights", Store(broken), engine)  # never started: fed here
    for poll in polls:
        follower._apply(poll)
    return engine


@settings(max_examples=3000, deadline=None)
@given(streams())
def test_a_poll_of_notices_ends_where_reading_them_one_by_one_would(stream):
    notices, broken, cuts = stream
    bounds = [0, *[c for c in cuts if c < len(notices)], len(notices)]
    polls = [notices[a:b] for a, b in zip(bounds, bounds[1:]) if a < b]
    assert follow(polls, broken).policy_version == follow([[n] for n in notices], broken).policy_version


@settings(max_examples=3000, deadline=None)
@given(streams())
def test_once_released_a_replica_serves_what_it_would_have_without_the_hold(stream):
    notices, broken, cuts = stream
    held = None
    for m in notices:
        if m.action == "hold":
            held = m.version
        elif m.action == "release" and m.version == held:
            held = None
    marks = [n for n in notices if n.action in ("hold", "release")]
    learner = [n for n in notices if n.action not in ("hold", "release")]
    unheld = follow([learner], broken).policy_version
    if marks and held is None and unheld != 0:  # (no notice names the starting weights)
        bounds = [0, *[c for c in cuts if c < len(notices)], len(notices)]
        polls = [notices[a:b] for a, b in zip(bounds, bounds[1:]) if a < b]
        assert follow(polls, broken).policy_version == unheld
