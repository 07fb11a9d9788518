"""Join rewards to interactions inside a reward window, on record time.

Interactions and rewards arrive on two topics, co-partitioned by interaction id
but read in no guaranteed relative order. :class:`RewardJoiner` holds each side
until the other arrives:

* an interaction waits for rewards until its window closes: ``window_s`` after
  the interaction's record timestamp. Then it is *ready* with the default reward
  or dropped (``RewardConfig.on_missing``), counted either way;
* an interaction with at least one reward is *ready* at once and stays ready
  until a learner step takes it (:meth:`RewardJoiner.pop_ready`); rewards that
  arrive in between, within the window, still join. Several rewards combine
  with ``RewardConfig.aggregation`` (first, last, sum, mean; per-turn rewards
  combine the same way, turn by turn). With ``RewardConfig.wait_for_sources``
  it is ready only once each of those sources rated it, or when its window
  closes with some of them (counted); rewards from a source outside
  ``RewardConfig.sources`` are counted and never applied;
* a reward for an interaction not seen yet is held (it was read first, from
  another partition or consumer) and joins when the interaction arrives; held
  rewards expire ``window_s`` after their own timestamp (counted);
* a reward for an interaction already taken for training, dropped or closed is
  counted and logged as late and never applied;
* grpo (``group_size > 1``): ready rollouts of one prompt are handed out in groups of
  ``group_size``; a group still incomplete ``reward.group_timeout_s`` after its oldest
  member became ready (a member's reward was dropped, say) is handed out as it is and
  counted, and so is the oldest incomplete group while more than ``max_pending`` members of
  incomplete groups are held (with no timeout, too); the record time from a group's first
  member being ready to its handing out is summed (``group_wait_s``).

Clock: windows are measured on *record timestamps*, never on the wall clock.
The joiner's clock (the watermark) is the largest timestamp of any record it was
given, so replaying the same records in the same order makes the same decisions
(a restarted learner re-reads its topics from checkpointed offsets and joins
them exactly as before). Consequences worth knowing: windows close only as
newer records arrive (a quiet stream keeps its last interactions waiting). While
one topic still has records to read, the feed holds the clock at the newest time
read from it (``clock``: trainer/join_clock.py), so catching up a
backlog does not close windows whose rewards are simply unread yet; a replay may
then read in another order than the first pass and decide a window differently.

Trajectories (multi-turn and agent use): :mod:`trainer.join_trajectories`. What is ready, and
in which units (rollouts, grpo groups): :mod:`trainer.join_ready`.

Exactly once, with finite memory: finished ids are remembered in an
:class:`~trainer.id_memory.IdMemory` by creation time for ``reward.memory_s``;
an interaction created before the memory's floor is refused and counted
(``expired_interactions``), so no copy, however late, is trained twice. A
continuation whose trajectory began before the floor (``trajectory_started_at``)
trains none of the earlier turns the memory does not know: they may have trained
and been forgotten (``forgotten_turns``; at most once rather than twice).

Memory is bounded by ``max_pending`` per kind of held item (waiting
interactions, held rewards, remembered finished ids); past it the oldest is
given up and counted (for finished ids: the memory's floor rises). Ready
interactions are not capped here: the learner reads no more records (its feed polls with its
partitions paused) while enough are ready that :meth:`pop_ready` could hand out. Members of
incomplete grpo groups are not among those: past ``max_pending`` of them, the oldest incomplete
group is handed out as it is (counted in ``incomplete_groups``). The full state round-trips
through :meth:`state_dict` / :meth:`load_state_dict` as JSON-serialisable data
(:mod:`trainer.join_checkpoint`).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import OrderedDict
from typing import Any, Callable, Iterable

from online_sao.config import RewardConfig
from online_sao.schemas import ABORTED, Interaction, Reward
from trainer.id_memory import IdMemory, MemorySnapshot, anchor_time
from trainer.join_checkpoint import joiner_state, load_joiner_state
from trainer.join_ready import ReadyUnits
from trainer.join_state import (Contribution, Entry, JoinCounters, JoinedInteraction, aggregate, combine_rewards,
                                combine_scores, prompt_group_key, reward_key, rewards_by_source)

__all__ = ["JoinCounters", "JoinedInteraction", "RewardJoiner", "aggregate", "prompt_group_key"]

log = logging.getLogger(__name__)

MAX_REWARDS_PER_INTERACTION = 64
"""Rewards one interaction may gather (its own and, for a continuation, its absorbed ancestors'):
feedback, a judge and an environment give a handful. Past it a reward is counted
(``excess_rewards``) and not applied, so one client cannot grow the join's memory, and the copy
check that scans an interaction's rewards, without bound (6000 rewards for one id were all held,
each scanning the ones before)."""
DEADLINE_SLACK = 1_024
"""Closed windows the deadline heap may still hold (lazy deletion) beyond twice the waiting ones
before it is rebuilt from them."""


class RewardJoiner(ReadyUnits):
    """See the module docstring. Timestamps are seconds of record time."""

    def __init__(self, cfg: RewardConfig, max_pending: int = 100_000) -> None:
        self.cfg = cfg
        self.max_pending = max_pending
        self.watermark: float | None = None
        self.counters = JoinCounters()
        self.memory = IdMemory(cfg.id_memory_s, max_pending)
        self._waiting: dict[str, Entry] = {}
        self._ready: OrderedDict[str, Entry] = OrderedDict()
        self._held: OrderedDict[str, list[Contribution]] = OrderedDict()
        self._claims: dict[str, str] = {}  # ancestor id -> id of the pending continuation holding it
        self._deadlines: list[tuple[float, str]] = []  # heap over waiting windows (lazy deletion)

    # -- input ---------------------------------------------------------------------------
    def add_interaction(self, interaction: Interaction, ts: float, clock: float | None = None,
                        admit: Callable[[Interaction], bool] | None = None) -> None:
        """``interaction`` read with record time ``ts``; ``clock``: how far the join's clock may move
        (None: to ``ts``; readers hold it back while catching up: trainer/join_clock.py). ``admit``:
        whether a new interaction can train at all (trainer/untrainable.py; it counts what it refuses):
        one it refuses is finished untrained, as a cut answer is, so its copies count as duplicates
        and its rewards as late."""
        self._tick(ts, clock)
        iid = interaction.interaction_id
        anchor = anchor_time(interaction.created_at, ts)
        self.counters.interactions += 1
        known = self.memory.get(iid)
        claim = self._claim_of(iid)
        if self._pending(iid) is not None or (known is not None and known.seen) or (claim is not None and claim.seen):
            self.counters.duplicate_interactions += 1  # a copy (of a record absorbed by a continuation, too)
            return
        if known is not None or iid in self._claims:  # its turns are (or were) in a continuation
            self._arrived_superseded(iid, anchor)
            return
        if self.memory.forgotten(anchor):
            self.counters.expired_interactions += 1
            log.info("interaction %s created before the id memory's floor: refused", iid)
            return
        if interaction.finish_reason == ABORTED and not self.cfg.train_aborted:
            self._refuse_aborted(iid, anchor)
            return
        if admit is not None and not admit(interaction):
            self.counters.late_rewards += len(self._held.pop(iid, []))
            self.memory.remember(iid, anchor, trained=False, seen=True)
            return
        entry = Entry(interaction, ts, anchor)
        for contribution in self._pop_held(iid):
            self._join_own(entry, contribution)
        self._claim_ancestors(entry)
        if self._rated(entry):
            self._make_ready(entry)
            return
        if self.watermark is not None and self._window_end(entry) < self.watermark:  # read after its window closed
            self._close(entry)
            return
        if len(self._waiting) >= self.max_pending:
            self._evict_oldest_waiting()
        self._waiting[iid] = entry
        heapq.heappush(self._deadlines, (self._window_end(entry), iid))
        if len(self._deadlines) > 2 * len(self._waiting) + DEADLINE_SLACK:  # mostly closed windows
            self._deadlines = [(self._window_end(e), i) for i, e in self._waiting.items()]
            heapq.heapify(self._deadlines)

    def add_reward(self, reward: Reward, ts: float, clock: float | None = None) -> None:
        """``reward`` read with record time ``ts``; ``clock`` as for :meth:`add_interaction`."""
        self._tick(ts, clock)
        iid = reward.interaction_id
        self.counters.rewards += 1
        if self.cfg.sources is not None and reward.source not in self.cfg.sources:
            self.counters.ignored_rewards += 1
            return
        contribution = Contribution(reward.value, {t.turn: t.value for t in reward.turn_rewards}, ts,
                                    scores=dict(reward.scores or {}), key=reward_key(reward), source=reward.source)
        entry = self._pending(iid)
        if entry is None and iid in self._claims:  # absorbed: the reward joins its continuation
            owner = self._pending(self._claims[iid])
            if self._past_window(owner, ts):
                self._late(iid, reward)
            elif not self._duplicate(owner.contributions, contribution) and not self._full(owner.contributions):
                self._join_routed(owner, contribution, iid)
            return
        if iid in self.memory or (entry is not None and self._past_window(entry, ts)):
            self._late(iid, reward)
            return
        if entry is None:
            if self._duplicate(self._held.get(iid, ()), contribution) or self._full(self._held.get(iid, ())):
                return
            self.counters.early_rewards += 1
            if iid not in self._held and len(self._held) >= self.max_pending:
                _, given_up = self._held.popitem(last=False)
                self.counters.evicted += len(given_up)  # each one: every reward read is accounted for
            self._held.setdefault(iid, []).append(contribution)
            return
        if self._duplicate(entry.contributions, contribution) or self._full(entry.contributions) \
                or self._names_missing_turn(entry, contribution):
            return
        entry.contributions.append(contribution)
        if iid in self._waiting and self._rated(entry):
            del self._waiting[iid]
            self._make_ready(entry)

    def _full(self, joined: list[Contribution] | tuple) -> bool:
        """Whether ``joined`` holds :data:`MAX_REWARDS_PER_INTERACTION` rewards already (counted)."""
        if len(joined) < MAX_REWARDS_PER_INTERACTION:
            return False
        self.counters.excess_rewards += 1
        if self.counters.excess_rewards == 1:
            log.warning("an interaction has %d rewards already: later ones are not applied (excess_rewards)",
                        MAX_REWARDS_PER_INTERACTION)
        return True

    def _duplicate(self, joined: Iterable[Contribution], contribution: Contribution) -> bool:
        """Whether ``contribution`` is a copy of a reward already in ``joined`` (counted, and logged)."""
        if not any(c.key == contribution.key for c in joined):
            return False
        self.counters.duplicate_rewards += 1
        log.info("a copy of a reward already joined (digest %s) is ignored", contribution.key)
        return True

    def _tick(self, ts: float, clock: float | None) -> None:
        to = ts if clock is None else min(ts, clock)
        if to > -math.inf:  # nothing read yet of a topic still to read: the clock waits for it
            self.advance(to)

    def advance(self, ts: float) -> None:
        """Move the record-time clock forward to ``ts`` and close windows that ended."""
        if self.watermark is not None and ts <= self.watermark:
            return
        self.watermark = ts
        while self._deadlines and self._deadlines[0][0] < ts:
            _, iid = heapq.heappop(self._deadlines)
            entry = self._waiting.pop(iid, None)
            if entry is not None:
                self._close(entry)
        while self._held:
            iid, contributions = next(iter(self._held.items()))
            if contributions[0].ts + self.cfg.window_s >= ts:
                break
            del self._held[iid]
            kept = [c for c in contributions if c.ts + self.cfg.window_s >= ts]  # each expires on its own
            self.counters.expired_rewards += len(contributions) - len(kept)
            if kept:  # checked again when the loop reaches it, and when its interaction comes (_pop_held)
                self._held[iid] = kept
        self.memory.advance(ts)

    # -- output --------------------------------------------------------------------------
    def pop_ready(self, max_rollouts: int, token_budget: int, group_size: int = 1,
                  min_units: int = 1) -> list[JoinedInteraction]:
        """Take ready interactions, oldest first, until ``max_rollouts`` or until
        ``token_budget`` action tokens are reached (whole grpo groups only when
        ``group_size > 1``), but at least ``min_units`` rollouts (groups) with action tokens to train
        where that many are ready: a step of several ranks needs one for each, and a step short of
        them was dropped. Taken ids count as finished: later rewards are late."""
        taken: list[JoinedInteraction] = []
        tokens = units = 0
        ready = list(self._ready.values())
        groups = self._groups(ready, group_size) if group_size > 1 else [[e] for e in ready]
        for group_id, group in enumerate(groups):
            if units >= min_units and (len(taken) + len(group) > max_rollouts or tokens >= token_budget):
                break
            if group_size > 1:
                self._count_group(group, group_size)
            unit_tokens = 0
            for entry in group:
                if entry.iid not in self._ready:
                    continue  # absorbed by a continuation taken before it in this pass
                taken.append(self._take(entry, group_id if group_size > 1 else -1))
                unit_tokens += taken[-1].num_action_tokens
            tokens += unit_tokens
            units += unit_tokens > 0
        return taken

    def drop_stale(self, min_version: int) -> int:
        """Drop ready interactions whose newest sampling version is below ``min_version``
        (counted as stale; later rewards for them are late). Returns how many."""
        stale = [e for e in self._ready.values() if e.interaction.policy_version < min_version]
        for entry in stale:
            del self._ready[entry.iid]
            self._finish_untrained(entry)
        self.counters.stale += len(stale)
        return len(stale)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_held_rewards(self) -> int:
        return len(self._held)

    # -- checkpointing (trainer/join_checkpoint.py) ---------------------------------------
    def state_dict(self, with_memory: bool = True) -> dict[str, Any]:
        """The join's state as JSON-serialisable data; without the id memory (a checkpoint takes
        :meth:`IdMemory.snapshot` and writes it in a file of its own) if not ``with_memory``."""
        return joiner_state(self, with_memory)

    def load_state_dict(self, state: dict[str, Any], memory: MemorySnapshot | None = None) -> None:
        """Restore :meth:`state_dict`, the id memory from ``memory`` when given (else from ``state``);
        also reads checkpoints written before trajectories and the id memory."""
        load_joiner_state(self, state, memory)

    # -- internals: arrivals -------------------------------------------------------------
    def _pending(self, iid: str) -> Entry | None:
        return self._waiting.get(iid) or self._ready.get(iid)

    def _window_end(self, entry: Entry) -> float:
        return entry.ts + self.cfg.window_s

    def _past_window(self, entry: Entry, ts: float) -> bool:
        """Whether a reward stamped ``ts``, read now, comes too late for pending ``entry``: stamped past
        its window, or read after the window closed: the entry stopped waiting for rewards
        (:attr:`Entry.closed`), or, rated and waiting for a step, the join's clock passed its end (a
        reward cannot move the clock past the window it is stamped in: :meth:`_tick`). Either way the
        outcome does not hang on whether a step took the entry first."""
        end = self._window_end(entry)
        return entry.closed or ts > end or (self.watermark is not None and self.watermark > end)

    def _pop_held(self, iid: str) -> list[Contribution]:
        """The rewards held for ``iid`` that have not expired (those that have are counted): the loop in
        :meth:`advance` releases them in the order their ids were first held, so a reward behind a newer
        one may outlive its window there."""
        held = self._held.pop(iid, [])
        live = [c for c in held if self.watermark is None or c.ts + self.cfg.window_s >= self.watermark]
        self.counters.expired_rewards += len(held) - len(live)
        return live

    def _late(self, iid: str, reward: Reward) -> None:
        self.counters.late_rewards += 1
        log.info("late reward for interaction %s (value %s, source %s) not applied", iid, reward.value, reward.source)

    def _join_own(self, entry: Entry, contribution: Contribution) -> None:
        if contribution.ts > self._window_end(entry):
            self.counters.late_rewards += 1
            log.info("late reward for interaction %s (held, past the window) not applied", entry.iid)
            return
        if not self._names_missing_turn(entry, contribution):
            entry.contributions.append(contribution)

    # -- internals: ends -----------------------------------------------------------------
    def _make_ready(self, entry: Entry) -> None:
        if not entry.defaulted:
            self.counters.joined += 1
        entry.ready_at = max(entry.ts, self.watermark if self.watermark is not None else entry.ts)
        self._ready[entry.iid] = entry

    def _rated(self, entry: Entry) -> bool:
        """Whether ``entry`` has a reward of its own from every source it waits for (at least one
        reward when it waits for none: ``reward.wait_for_sources``)."""
        rated_by = {c.source for c in entry.contributions if c.origin is None}
        return bool(rated_by) and rated_by.issuperset(self.cfg.wait_for_sources)

    def _close(self, entry: Entry) -> None:
        """The window of an interaction not rated by every source it waits for ended."""
        entry.closed = True
        if entry.own_rewarded:  # some of them rated it: trained on what they said
            self.counters.missing_sources += 1
            self._make_ready(entry)
        elif self.cfg.on_missing == "default":
            self.counters.defaulted += 1
            entry.defaulted = True
            self._make_ready(entry)
        elif entry.contributions:  # its ancestors' rewards: they train it
            self._make_ready(entry)
        else:
            self.counters.dropped_no_reward += 1
            self._finish_untrained(entry)

    def _refuse_aborted(self, iid: str, anchor: float) -> None:
        """A cut answer (``reward.train_aborted`` off): finished untrained before it claims any
        ancestor, so its ancestors' complete answers train on their own; its held rewards and any
        later ones are not applied (counted late)."""
        self.counters.aborted += 1
        self.counters.late_rewards += len(self._held.pop(iid, []))
        self.memory.remember(iid, anchor, trained=False, seen=True)
        log.info("interaction %s was cut (finish_reason abort): not trained as its own rollout", iid)

    def _evict_oldest_waiting(self) -> None:
        while self._deadlines:
            _, iid = heapq.heappop(self._deadlines)
            entry = self._waiting.pop(iid, None)
            if entry is not None:
                if entry.own_rewarded:  # waiting for more sources: trained on what it has instead
                    self.counters.missing_sources += 1
                    entry.closed = True
                    self._make_ready(entry)
                else:
                    self.counters.evicted += 1
                    self._finish_untrained(entry)
                return

    def _finish_untrained(self, entry: Entry) -> None:
        """Dropped, stale or evicted: nothing of it trained. Absorbed ancestors share its fate;
        ancestors it only claimed are released (read later, they join as if new)."""
        self.memory.remember(entry.iid, entry.anchor, trained=False, seen=True)
        for iid, claim in entry.claimed.items():
            del self._claims[iid]
            if claim.seen:
                self.memory.remember(iid, claim.anchor, trained=False, seen=True)

    def _take(self, entry: Entry, group_id: int) -> JoinedInteraction:
        """Hand ``entry`` to a step: turns trained earlier become observations, the rest and
        every origin in them count as trained from now on."""
        del self._ready[entry.iid]
        observed = self._train_turns(entry)
        self.memory.remember(entry.iid, entry.anchor, trained=True, seen=True)
        reward, turns, dropped = combine_rewards(entry, observed, self.cfg)
        self.counters.trained_turn_rewards += dropped
        return JoinedInteraction(entry.interaction, reward, turns, entry.own_rewarded, entry.ts, group_id,
                                 frozenset(observed), combine_scores(entry, self.cfg),
                                 rewards_by_source(entry, self.cfg),
                                 defaulted=entry.defaulted and not entry.contributions)  # no reward at all
