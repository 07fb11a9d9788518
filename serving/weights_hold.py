"""An operator's hold on serving's weights: answer with one version until released.

``online-sao weights hold`` puts a ``hold`` notice on the weights topic (a compaction key of its
own, so the newest hold or release is never compacted away): every replica loads the held version
(forced, older or not) and stops following the learner's publishes and rollbacks; a canary's
champion still follows ``champion`` notices but answers no request until the release.
``online-sao weights release`` puts a ``release`` notice naming the held version: the replica then
goes where the notices it deferred lead, as if the hold had never been: back to what it served
before the hold, or to what the learner published or rolled back to since. A release naming another
version (sent for an earlier hold, which another operator moved meanwhile) is ignored, with a log
line, as a release with no hold in force is. A replica replaying the topic as it starts logs the
hold the replay ends in (if any), not each hold and release of the topic's history.

A hold whose version cannot be loaded (its file gone, corrupt) leaves the replica where the notices
before it led, still held: on the weights it has, or, when those notices come in the same poll (a
replica replaying the topic as it starts), on the version they lead to, as reading them one by one
would. An operator who asked for a hold gets no version the learner publishes after it. The
learner is not told: it keeps training on the held version's answers (off-policy, weighed by the
importance ratio and masked where it leaves the trust band) and keeps publishing.
"""

from __future__ import annotations

import logging
from collections import deque

from online_sao.schemas import WeightsNotice

log = logging.getLogger(__name__)

MAX_DEFERRED = 256
"""Notices kept while held, newest last, for the release to follow. Only the newest rollback and
the publishes after it decide where a release goes; a hold that outlasts this many notices forgets
the oldest (the newest publish is still among those kept)."""

HELD = "weights held at v%d by an operator (%s); the learner's versions are not followed until a release"
"""The warning of a hold in force (its version, its reason)."""


def plan(notices: list[WeightsNotice], current: int) -> list[tuple[WeightsNotice, bool]]:
    """``(notice, force)`` to try, most lasting first, for notices read in this order."""
    chain: list[tuple[WeightsNotice, bool]] = []
    top, forced = current, False
    for notice in notices:
        if notice.action == "rollback":
            forced = True
        elif notice.version <= top:
            continue
        chain.append((notice, forced))
        top = notice.version
    return chain[::-1]


class HoldState:
    """What a replica's weights follow: the learner's notices, or an operator's hold.

    :meth:`take` reads one poll's ``publish``, ``rollback``, ``hold`` and ``release`` notices in
    topic order and says which to try to load, most lasting first (:func:`plan`); :meth:`applied`
    is told which one was loaded.

    ``replaying``: the notices come from a replica's replay of the topic at its start (the follower's
    first pass), history rather than news: the holds and releases in it are not logged one by one (a
    restarted replica logged every hold and release ever made as if made now); :meth:`end_replay`
    logs the state the replay ends in."""

    def __init__(self, replaying: bool = False) -> None:
        self.replaying = replaying
        self.hold: WeightsNotice | None = None
        """The hold in force (None: following the learner)."""
        self._serving: WeightsNotice | None = None
        """The learner's notice whose weights the replica loaded last, where a release returns to."""
        self._deferred: deque[WeightsNotice] = deque(maxlen=MAX_DEFERRED)

    @property
    def held_version(self) -> int:
        """The held version, -1 when none is held (for the metrics)."""
        hold = self.hold  # read once: the metrics scrape runs in another thread than the follower's release
        return -1 if hold is None else hold.version

    def take(self, notices: list[WeightsNotice], current: int) -> list[tuple[WeightsNotice, bool]]:
        """``(notice, force)`` to try for these notices, given the version the engine serves now:
        where reading them one by one would have ended, and behind it where it would have ended had
        that version failed to load, and so on."""
        marks = [k for k, notice in enumerate(notices) if notice.action in ("hold", "release")]
        if not marks:
            if self.hold is not None:
                self._deferred.extend(notices)
                return []
            pending = [*self._deferred, *notices]
            self._deferred.clear()
            return plan(pending, current)
        last = marks[-1]
        before = self.take(notices[:last], current)  # where the notices before the last hold or release lead
        mark, after = notices[last], notices[last + 1:]
        if mark.action == "release":
            if self.hold is None:  # a release without a hold changes nothing
                return plan([*(notice for notice, _ in reversed(before)), *after], current)
            if mark.version != self.hold.version:  # sent for an earlier hold (read before this one was made)
                self._news("a release of v%d ignored: the hold in force is v%d's, which only a release of v%d "
                           "ends", mark.version, self.hold.version, self.hold.version)
                self._deferred.extend(after)
                return before
            self._news("weights hold released; following the learner's versions again")
            self.hold = None
            pending = list(self._deferred)
            self._deferred.clear()
            pending += after
            if self._serving is not None:  # back to it unless the learner moved on since
                pending.insert(0, self._serving.model_copy(update={"action": "rollback"}))
            elif pending:  # none of the learner's versions loaded before the hold: its notices, forced
                # over the held weights (a version they name may be the held one, then served as the learner's)
                pending[0] = pending[0].model_copy(update={"action": "rollback"})
            return plan(pending, current)
        if self.hold is None:
            # not loaded yet, these are where a release goes as well as the fallback of a hold that
            # cannot be loaded (a replica replaying the topic at its start: the learner's notices
            # come in the same poll as the hold)
            self._deferred.extend(notice for notice, _ in reversed(before))
        self.hold = mark
        self._deferred.extend(after)
        self._news(HELD, mark.version, mark.reason or "no reason given")
        if current == mark.version:  # a hold re-sent (a new reason) or of the version served: no reload
            return []
        return [(mark, True), *before]

    def end_replay(self) -> None:
        """The replay of the topic is over: say the hold it ended in, if any; later notices are news."""
        hold = self.hold
        if self.replaying and hold is not None:
            log.warning(HELD, hold.version, hold.reason or "no reason given")
        self.replaying = False

    def _news(self, message: str, *args: object) -> None:
        """A warning for a hold's change made now, not one replayed from the topic's history."""
        if not self.replaying:
            log.warning(message, *args)

    def applied(self, notice: WeightsNotice) -> None:
        """``notice``'s weights are now served."""
        if notice.action != "hold":
            self._serving = notice
