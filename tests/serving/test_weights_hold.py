"""An operator's hold: which notices a replica loads while held and after the release (a following
engine held and released: tests/serving/test_weights_follower.py)."""

from __future__ import annotations

from online_sao.schemas import WeightsNotice
from serving.weights_hold import MAX_DEFERRED, HoldState


def n(version: int, action: str = "publish") -> WeightsNotice:
    return WeightsNotice(action=action, version=version, location=f"mem://{version}", checksum="0" * 64)


def tried(chain) -> list[tuple[int, str, bool]]:
    return [(x.version, x.action, force) for x, force in chain]


def loaded(state: HoldState, notices: list[WeightsNotice], current: int) -> int:
    """Take ``notices`` and load the first one offered (every load succeeds): the version served after."""
    chain = state.take(notices, current)
    if not chain:
        return current
    first = chain[0][0]
    state.applied(first)
    return first.version


def test_without_a_hold_the_learners_notices_are_followed_as_before():
    state = HoldState()
    assert tried(state.take([n(1), n(3), n(2)], current=0)) == [(3, "publish", False), (1, "publish", False)]
    assert state.held_version == -1


def test_a_hold_forces_an_older_version_and_defers_the_learners_notices():
    state = HoldState()
    assert loaded(state, [n(1), n(2), n(3)], current=0) == 3
    assert tried(state.take([n(1, "hold")], current=3)) == [(1, "hold", True)]
    state.applied(n(1, "hold"))
    assert state.held_version == 1
    assert state.take([n(4), n(5), n(2, "rollback")], current=1) == []  # nothing loads while held


def test_a_release_goes_where_the_deferred_notices_lead():
    state = HoldState()
    assert loaded(state, [n(3)], current=0) == 3
    assert loaded(state, [n(1, "hold")], current=3) == 1
    assert state.take([n(4), n(5)], current=1) == []
    chain = state.take([n(1, "release")], current=1)
    # the pre-hold version first as a forced fallback, then 4 and 5 over it: 5 is tried first
    assert tried(chain) == [(5, "publish", True), (4, "publish", True), (3, "rollback", True)]
    assert state.held_version == -1


def test_a_release_with_nothing_published_meanwhile_returns_to_the_pre_hold_version():
    state = HoldState()
    assert loaded(state, [n(3)], current=0) == 3
    assert loaded(state, [n(1, "hold")], current=3) == 1
    assert loaded(state, [n(1, "release")], current=1) == 3


def test_a_rollback_during_the_hold_is_obeyed_at_the_release():
    state = HoldState()
    assert loaded(state, [n(2), n(6)], current=0) == 6
    assert loaded(state, [n(6, "hold")], current=6) == 6  # held at the version it serves: nothing to load
    assert state.take([n(7), n(2, "rollback"), n(3)], current=6) == []
    assert loaded(state, [n(6, "release")], current=6) == 3  # the rollback to 2 forced, then 3 published


def test_a_replica_starting_during_a_hold_loads_the_held_version_and_follows_after_the_release():
    state = HoldState()
    assert loaded(state, [n(1), n(2), n(1, "hold"), n(3)], current=0) == 1  # the topic replayed
    assert loaded(state, [n(1, "release")], current=1) == 3


def test_a_replica_starting_during_a_hold_it_cannot_load_serves_the_learners_version():
    """The topic replayed in one poll: the learner's notices come with the hold. When the held
    version cannot be loaded (its file pruned), the replica stays where the notices before the hold
    led, as it would have had it read them one by one; it loaded nothing and served its starting
    weights before (found by test_weights_follower_batches.py)."""
    state = HoldState()
    chain = state.take([n(1), n(2), n(1, "hold"), n(3)], current=0)
    assert tried(chain) == [(1, "hold", True), (2, "publish", False), (1, "publish", False)]
    state.applied(chain[1][0])  # the hold's load failed; the learner's v2 loaded
    assert state.held_version == 1 and state.take([n(4)], current=2) == []  # still held
    assert loaded(state, [n(1, "release")], current=2) == 4


def test_a_second_hold_released_returns_to_the_learners_version_when_none_had_loaded_before():
    """v1's file is gone: the replica served no learner version before the first hold, and the first
    release found it on v3 already (the held copy). The second release returned to nothing and left
    it on the held v2; now the learner's notices are forced over the held weights at a release (found
    by an exhaustive search of notice streams, serving one notice per poll as the reference)."""
    state = HoldState()
    assert tried(state.take([n(1)], current=0)) == [(1, "publish", False)]  # its load fails: nothing applied
    assert tried(state.take([n(1, "hold")], current=0)) == [(1, "hold", True)]  # fails too
    assert state.take([n(2)], current=0) == [] and state.take([n(3)], current=0) == []
    assert loaded(state, [n(3, "hold")], current=0) == 3
    assert loaded(state, [n(3, "release")], current=3) == 3  # the learner's v3, forced over the held copy
    assert loaded(state, [n(2, "hold")], current=3) == 2
    assert loaded(state, [n(2, "release")], current=2) == 3


def test_a_hold_and_its_release_in_one_poll_leave_the_learners_version():
    state = HoldState()
    assert loaded(state, [n(1), n(2), n(1, "hold"), n(3), n(1, "release")], current=0) == 3


def test_a_release_without_a_hold_and_a_resent_hold_change_nothing():
    state = HoldState()
    assert loaded(state, [n(4)], current=0) == 4
    assert state.take([n(4, "release")], current=4) == []
    assert loaded(state, [n(2, "hold")], current=4) == 2
    assert state.take([n(2, "hold")], current=2) == []  # a new reason, the same version: no reload
    assert tried(state.take([n(3, "hold")], current=2)) == [(3, "hold", True)]  # the hold moved


def test_a_hold_that_cannot_be_loaded_keeps_the_replica_held_on_what_it_has():
    state = HoldState()
    assert loaded(state, [n(4)], current=0) == 4
    assert tried(state.take([n(2, "hold")], current=4)) == [(2, "hold", True)]  # the load fails: applied() not called
    assert state.held_version == 2
    assert state.take([n(5)], current=4) == []  # still held: no publish is followed
    assert loaded(state, [n(2, "release")], current=4) == 5


def test_a_long_hold_keeps_the_newest_notices_for_its_release():
    state = HoldState()
    assert loaded(state, [n(1), n(1, "hold")], current=0) == 1
    state.take([n(v) for v in range(2, MAX_DEFERRED + 50)], current=1)
    assert loaded(state, [n(1, "release")], current=1) == MAX_DEFERRED + 49


def test_a_release_sent_for_an_earlier_hold_leaves_the_hold_that_replaced_it(caplog):
    """Operator A's release of v1, built from the topic read before operator B moved the hold to v2,
    landed after B's hold and ended it on every replica."""
    state = HoldState()
    assert loaded(state, [n(1), n(2), n(3)], current=0) == 3
    assert loaded(state, [n(1, "hold")], current=3) == 1
    assert loaded(state, [n(2, "hold")], current=1) == 2
    assert state.take([n(4), n(1, "release"), n(5)], current=2) == []  # ignored: still held, nothing loads
    assert state.held_version == 2
    assert "a release of v1 ignored: the hold in force is v2's" in caplog.text
    assert loaded(state, [n(2, "release")], current=2) == 5  # B's own release ends it: the learner's newest


def test_a_release_of_the_hold_in_force_still_ends_it():
    state = HoldState()
    assert loaded(state, [n(1), n(2), n(3)], current=0) == 3
    assert loaded(state, [n(1, "hold")], current=3) == 1
    assert loaded(state, [n(1, "release")], current=1) == 3
    assert state.held_version == -1


def replayed_and_live(notices: list[WeightsNotice]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(served, held) of a replica that starts after ``notices`` and replays them in one poll, and of
    one that followed them live, a poll each."""
    replay, live = HoldState(), HoldState()
    served = loaded(replay, notices, current=0)
    current = 0
    for notice in notices:
        current = loaded(live, [notice], current)
    return (served, replay.held_version), (current, live.held_version)


def test_a_replica_replaying_the_topic_ends_where_one_that_followed_it_live_did():
    race = [n(1), n(2), n(3), n(1, "hold"), n(2, "hold"), n(1, "release"), n(4)]
    replayed, live = replayed_and_live(race)
    assert replayed == live == (2, 2)
    several = [*race, n(2, "release"), n(5), n(3, "hold"), n(2, "release"), n(6), n(3, "hold"), n(7)]
    expected = {len(race) + 1: (4, -1), len(race) + 2: (5, -1), len(race) + 4: (3, 3), len(several): (3, 3)}
    for end, (served, held) in expected.items():
        replayed, live = replayed_and_live(several[:end])
        assert replayed == live == (served, held), several[:end]
    replayed, live = replayed_and_live([*several, n(3, "release")])
    assert replayed == live == (7, -1)


class ReleasedBetweenReads(HoldState):
    """A hold the follower releases right after the metrics thread's first look at it."""

    def __init__(self, hold: WeightsNotice) -> None:
        super().__init__()
        self._reads = iter([hold])

    @property
    def hold(self) -> WeightsNotice | None:
        return next(self._reads, None)

    @hold.setter
    def hold(self, value: WeightsNotice | None) -> None:
        pass


def test_held_version_reads_the_hold_once_so_a_release_meanwhile_gives_a_version_not_an_error():
    assert ReleasedBetweenReads(n(3, "hold")).held_version == 3


def test_a_replay_that_ends_released_logs_nothing_and_later_holds_are_logged(caplog):
    """A replica's replay of the topic at its start: history, not news (each hold and release of it was
    logged as if made now)."""
    state = HoldState(replaying=True)
    assert loaded(state, [n(1), n(2, "hold"), n(2, "release"), n(1, "hold")], current=0) == 1
    assert loaded(state, [n(1, "release"), n(3)], current=1) == 3
    state.end_replay()
    assert caplog.text == ""
    assert loaded(state, [n(3, "hold")], current=3) == 3
    assert "weights held at v3 by an operator (no reason given)" in caplog.text
