"""The join's rules for multi-turn trajectories (a mixin of :class:`trainer.join.RewardJoiner`).

Trajectories (multi-turn and agent use; the rules in docs/ALGORITHM.md, "Multi-turn
trajectories"). A continuation repeats every earlier turn; ``turn_origins`` names
the interaction that sampled each. Each turn is trained once: when a rollout is
taken, turns whose origin was trained already become observations, the others
train and their origins count as trained. A continuation absorbs the ancestors
still waiting for a reward (and those not read yet, when they come): their
rewards join it, on their turns, without making it ready (only a reward for its
own id does; at its window's end it trains on the default reward, on its
ancestors' rewards alone, or is dropped with none). Rewarded ancestors train
alone unless the continuation is taken first. Branches of one conversation (two
continuations of one turn: a regenerated answer) share its earlier turns: the first
branch taken trains them, with the rewards joined for them, whichever branch had
claimed them. Rewards for a turn trained earlier are counted
(``trained_turn_rewards``), not applied; a reward rating a turn its interaction does
not have is counted (``misdirected_rewards``), not applied.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import replace

from trainer.id_memory import IdMemory
from trainer.join_state import Claim, Contribution, Entry, JoinCounters, last_turns

log = logging.getLogger("trainer.join")


class TrajectoryRules:
    """How continuations claim and absorb their ancestors. Works on the state of
    :class:`trainer.join.RewardJoiner`, which it is a base of (these attributes)."""

    memory: IdMemory
    counters: JoinCounters
    _waiting: dict[str, Entry]
    _ready: OrderedDict[str, Entry]
    _held: OrderedDict[str, list[Contribution]]
    _claims: dict[str, str]
    _pending: Callable[[str], Entry | None]
    _pop_held: Callable[[str], list[Contribution]]
    _window_end: Callable[[Entry], float]

    def _join_routed(self, owner: Entry, contribution: Contribution, origin: str) -> None:
        """A reward for absorbed interaction ``origin`` joins continuation ``owner``."""
        last = last_turns(owner.interaction).get(origin)
        if last is None or any(turn > last for turn in contribution.turns):
            self.counters.misdirected_rewards += 1
            log.info("reward for %s names a turn it does not have in continuation %s: not applied",
                     origin, owner.iid)
            return
        owner.contributions.append(replace(contribution, origin=origin))

    def _names_missing_turn(self, entry: Entry, contribution: Contribution) -> bool:
        """Whether ``contribution``, a reward for ``entry``'s own id, rates a turn the interaction does
        not have (counted as misdirected, logged). Serving refuses such feedback only while it holds
        the trajectory, and a judge writes to the topic directly; applied, the reward would make the
        whole rollout unbuildable (trainer/rollouts.py) and lose its other rewards with it."""
        turns = len(entry.interaction.turn_ends)
        if all(turn < turns for turn in contribution.turns):
            return False
        self.counters.misdirected_rewards += 1
        log.info("reward for %s names turn %d, but it has %d turn(s): not applied", entry.iid,
                 max(contribution.turns), turns)
        return True

    def _arrived_superseded(self, iid: str, anchor: float) -> None:
        """The record of an interaction whose turns a continuation holds (pending) or trained."""
        self.counters.superseded += 1
        held = self._pop_held(iid)
        owner_id = self._claims.get(iid)
        if owner_id is None:  # the continuation was trained already: so were these turns
            self.memory.remember(iid, anchor, trained=True, seen=True)
            self.counters.late_rewards += len(held)
            return
        owner = self._pending(owner_id)
        owner.claimed[iid] = Claim(anchor, seen=True)
        for contribution in held:
            if contribution.ts > self._window_end(owner):
                self.counters.late_rewards += 1
            else:
                self._join_routed(owner, contribution, iid)

    def _may_have_forgotten(self, entry: Entry) -> bool:
        """Whether ``entry``'s trajectory began before the id memory's floor: an ancestor the memory
        does not know may then have trained and been forgotten (time or capacity raised the floor)."""
        started = _trajectory_anchor(entry)
        return started is not None and self.memory.forgotten(started)

    def _claim_ancestors(self, entry: Entry) -> None:
        """A continuation arrived: absorb its waiting ancestors and claim those not read yet (unless
        they may have been forgotten: :meth:`_may_have_forgotten`)."""
        forgetful = self._may_have_forgotten(entry)
        for origin in last_turns(entry.interaction):
            if origin in self._claims or origin in self.memory or origin in self._ready:
                continue  # held by another continuation, finished, or rewarded and training alone
            ancestor = self._waiting.pop(origin, None)
            if ancestor is not None:
                self.counters.superseded += 1
                self._absorb(entry, ancestor)
                continue
            if forgetful:
                continue  # trained and forgotten, or not read yet: not trained here (_take)
            entry.claimed[origin] = Claim(entry.anchor, seen=False)
            self._claims[origin] = entry.iid
            for contribution in self._pop_held(origin):
                self._join_routed(entry, contribution, origin)

    def _absorb(self, entry: Entry, ancestor: Entry) -> None:
        """``ancestor`` (no longer pending) joins continuation ``entry`` with its rewards and claims."""
        entry.claimed[ancestor.iid] = Claim(ancestor.anchor, seen=True)
        for iid, claim in ancestor.claimed.items():
            entry.claimed[iid] = claim
        for iid in entry.claimed:
            self._claims[iid] = entry.iid
        for contribution in ancestor.contributions:
            self._join_routed(entry, contribution, contribution.origin or ancestor.iid)

    def _take_over_claim(self, entry: Entry, origin: str) -> None:
        """``entry`` is taken while another pending continuation (a branch of the same conversation:
        a regenerated answer) holds ``origin``: the turn trains in ``entry``, the first taken, so the
        claim moves to it with the rewards joined for ``origin``. Left behind, they would land on a
        turn trained already and never be applied."""
        owner = self._pending(self._claims[origin])
        entry.claimed[origin] = owner.claimed.pop(origin)
        self._claims[origin] = entry.iid
        moved = [c for c in owner.contributions if c.origin == origin]
        owner.contributions = [c for c in owner.contributions if c.origin != origin]
        for contribution in moved:
            self._join_routed(entry, contribution, origin)

    def _trained_turns(self, entry: Entry, trained: Collection[str] = ()) -> set[int]:
        """The turns :meth:`_train_turns` would make observations if ``entry`` were taken after
        entries that train the turns of the ids ``trained`` (no side effects: counts a step's
        tokens ahead)."""
        forgetful = self._may_have_forgotten(entry)
        observed: set[int] = set()
        for turn, origin in enumerate(entry.interaction.origins()):
            oid = origin.interaction_id
            if oid == entry.iid:
                continue
            known = self.memory.get(oid)
            if (known is not None and known.trained) or oid in trained:
                observed.add(turn)
            elif (known is None and forgetful and oid not in self._ready and oid not in entry.claimed
                  and self._claims.get(oid, entry.iid) == entry.iid):
                observed.add(turn)
        return observed

    def _train_turns(self, entry: Entry) -> set[int]:
        """``entry`` is taken: which of its turns are observations (trained earlier, or perhaps trained
        and forgotten); the others train here, and their origins count as trained from now on."""
        observed: set[int] = set()
        forgetful = self._may_have_forgotten(entry)
        for turn, origin in enumerate(entry.interaction.origins()):
            oid = origin.interaction_id
            known = self.memory.get(oid)
            if oid == entry.iid:
                continue
            if known is not None and known.trained:
                observed.add(turn)
            elif oid in self._ready:  # rewarded but not taken yet: its turns train here
                self.counters.superseded += 1
                self._absorb(entry, self._ready.pop(oid))
            elif self._claims.get(oid, entry.iid) != entry.iid:  # another branch of the conversation holds it
                self._take_over_claim(entry, oid)
            elif known is None and oid not in entry.claimed and forgetful:  # at most once, not twice
                observed.add(turn)
                self.counters.forgotten_turns += 1
        for oid, turn in last_turns(entry.interaction).items():
            if turn not in observed:
                claim = entry.claimed.get(oid) or self._claim_of(oid)
                self.memory.remember(oid, claim.anchor if claim else entry.anchor, trained=True,
                                     seen=bool(claim and claim.seen))
        for iid, claim in entry.claimed.items():
            del self._claims[iid]
            self.memory.remember(iid, claim.anchor, trained=True, seen=claim.seen)
        return observed

    def _claim_of(self, iid: str) -> Claim | None:
        owner = self._claims.get(iid)
        return None if owner is None else self._pending(owner).claimed[iid]


def _trajectory_anchor(entry: Entry) -> float | None:
    """The id memory's anchor of ``entry``'s first turn, as near as the join can tell (None: ``entry``
    starts its trajectory). ``trajectory_started_at`` is that turn's raw ``created_at``, but a record
    is remembered under ``min(created_at, record time)`` (trainer/id_memory.py), and on a server whose
    clock runs fast the feed reads record times at most a minute ahead of the learner's
    (trainer/feed.py): its records' anchors lie before their ``created_at``. A continuation is served
    by the process that holds its parent, so one clock stamped every turn: the first turn's anchor
    lies before its ``created_at`` by about what ``entry``'s own does."""
    started = entry.interaction.trajectory_started_at
    if started is None:
        return None
    return started - (entry.interaction.created_at - entry.anchor)
