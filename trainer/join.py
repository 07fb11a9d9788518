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
  combine the same way, turn by turn);
* a reward for an interaction not seen yet is held (it was read first, from
  another partition or consumer) and joins when the interaction arrives; held
  rewards expire ``window_s`` after their own timestamp (counted);
* a reward for an interaction already taken for training, dropped or closed is
  counted and logged as late and never applied.

Clock: windows are measured on *record timestamps*, never on the wall clock.
The joiner's clock (the watermark) is the largest timestamp of any record it was
given, so replaying the same records in the same order makes the same decisions
(a restarted learner re-reads its topics from checkpointed offsets and joins
them exactly as before). Consequences worth knowing: windows close only as
newer records arrive (a quiet stream keeps its last interactions waiting), and
if one partition is read far ahead of another a window may close before a
reward of the lagging partition is read (the reward then counts as late).

Memory is bounded by ``max_pending`` per kind of held item (waiting
interactions, held rewards, remembered finished ids); past it the oldest is
given up and counted. Ready interactions are not capped here: the learner
stops polling while enough are ready. The full state round-trips through
:meth:`state_dict` / :meth:`load_state_dict` as JSON-serialisable data.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from online_sao.batch import Rollout
from online_sao.config import RewardConfig
from online_sao.schemas import Interaction, Reward
from trainer.rollouts import interaction_to_rollout

log = logging.getLogger(__name__)

FINISHED_MEMORY_WINDOWS = 2.0
"""Finished ids are remembered this many windows past their interaction, so a
reward arriving after the window (a late one) is recognised as late rather than
held as a reward whose interaction is yet to come."""


@dataclass
class JoinCounters:
    """How records fared in the join, since the learner's first start."""

    interactions: int = 0
    rewards: int = 0
    joined: int = 0
    """Interactions that became ready with at least one reward."""
    defaulted: int = 0
    """Windows that closed without a reward and got the default reward."""
    dropped_no_reward: int = 0
    """Windows that closed without a reward and were dropped."""
    late_rewards: int = 0
    """Rewards for an interaction already trained on, dropped, or past its window (not applied)."""
    early_rewards: int = 0
    """Rewards read before their interaction (held, applied when it arrives)."""
    expired_rewards: int = 0
    """Held rewards whose interaction never arrived within the window."""
    duplicate_interactions: int = 0
    """Interaction ids seen a second time (ignored)."""
    evicted: int = 0
    """Waiting interactions or held rewards given up because the buffer was full."""
    stale: int = 0
    """Ready interactions dropped for sampling versions older than the allowed lag."""

    def metrics(self) -> dict[str, float]:
        return {f"join_{k}": float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class _Contribution:
    value: float
    turns: dict[int, float]
    ts: float


@dataclass
class _Entry:
    interaction: Interaction
    ts: float
    contributions: list[_Contribution] = field(default_factory=list)
    defaulted: bool = False


@dataclass
class JoinedInteraction:
    """An interaction ready to train on, with its combined rewards."""

    interaction: Interaction
    reward: float
    turn_rewards: dict[int, float]
    rewarded: bool
    """False when the reward is the default one (window closed without a reward)."""
    timestamp: float
    group_id: int = -1

    @property
    def num_action_tokens(self) -> int:
        return len(self.interaction.logprobs)

    def to_rollout(self) -> Rollout:
        return interaction_to_rollout(self.interaction, self.reward, self.turn_rewards, self.group_id)


def aggregate(values: list[float], mode: str) -> float:
    """Combine several rewards for one target (``values`` in arrival order)."""
    if not values:
        raise ValueError("no rewards to aggregate")
    if mode == "first":
        return values[0]
    if mode == "last":
        return values[-1]
    if mode == "sum":
        return float(sum(values))
    if mode == "mean":
        return float(sum(values) / len(values))
    raise ValueError(f"unknown reward aggregation {mode!r}")


def prompt_group_key(interaction: Interaction) -> str:
    """Rollouts of the same prompt form a grpo group."""
    return hashlib.sha256(",".join(map(str, interaction.prompt_ids)).encode()).hexdigest()


class RewardJoiner:
    """See the module docstring. Timestamps are seconds of record time."""

    def __init__(self, cfg: RewardConfig, max_pending: int = 100_000) -> None:
        self.cfg = cfg
        self.max_pending = max_pending
        self.watermark: float | None = None
        self.counters = JoinCounters()
        self._waiting: dict[str, _Entry] = {}
        self._ready: OrderedDict[str, _Entry] = OrderedDict()
        self._held: OrderedDict[str, list[_Contribution]] = OrderedDict()
        self._finished: OrderedDict[str, float] = OrderedDict()  # id -> forget-after time
        self._deadlines: list[tuple[float, str]] = []  # heap over waiting windows (lazy deletion)

    # -- input ---------------------------------------------------------------------------
    def add_interaction(self, interaction: Interaction, ts: float) -> None:
        self.advance(ts)
        iid = interaction.interaction_id
        self.counters.interactions += 1
        if iid in self._waiting or iid in self._ready or iid in self._finished:
            self.counters.duplicate_interactions += 1
            return
        entry = _Entry(interaction, ts)
        for contribution in self._held.pop(iid, []):
            if contribution.ts > self._window_end(entry):
                self.counters.late_rewards += 1
                log.info("late reward for interaction %s (held, past the window) not applied", iid)
            else:
                entry.contributions.append(contribution)
        if entry.contributions:
            self._make_ready(entry)
            return
        if self._window_end(entry) < self.watermark:  # read after its window already closed
            self._close(entry)
            return
        if len(self._waiting) >= self.max_pending:
            self._evict_oldest_waiting()
        self._waiting[iid] = entry
        heapq.heappush(self._deadlines, (self._window_end(entry), iid))

    def add_reward(self, reward: Reward, ts: float) -> None:
        self.advance(ts)
        iid = reward.interaction_id
        self.counters.rewards += 1
        contribution = _Contribution(reward.value, {t.turn: t.value for t in reward.turn_rewards}, ts)
        entry = self._waiting.get(iid) or self._ready.get(iid)
        if iid in self._finished or (entry is not None and ts > self._window_end(entry)):
            self.counters.late_rewards += 1
            log.info("late reward for interaction %s (value %s, source %s) not applied",
                     iid, reward.value, reward.source)
            return
        if entry is None:
            self.counters.early_rewards += 1
            if iid not in self._held and len(self._held) >= self.max_pending:
                self._held.popitem(last=False)
                self.counters.evicted += 1
            self._held.setdefault(iid, []).append(contribution)
            return
        entry.contributions.append(contribution)
        if iid in self._waiting:
            del self._waiting[iid]
            self._make_ready(entry)

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
            self._held.popitem(last=False)
            self.counters.expired_rewards += len(contributions)
        while self._finished and next(iter(self._finished.values())) < ts:
            self._finished.popitem(last=False)

    # -- output --------------------------------------------------------------------------
    def ready_stats(self, group_size: int = 1) -> tuple[int, int]:
        """(rollouts, action tokens) that :meth:`pop_ready` could hand out now."""
        entries = self._poppable(group_size)
        return len(entries), sum(len(e.interaction.logprobs) for e in entries)

    def pop_ready(self, max_rollouts: int, token_budget: int, group_size: int = 1) -> list[JoinedInteraction]:
        """Take ready interactions, oldest first, until ``max_rollouts`` or until
        ``token_budget`` action tokens are reached (whole grpo groups only when
        ``group_size > 1``). Taken ids count as finished: later rewards are late."""
        taken: list[JoinedInteraction] = []
        tokens = 0
        groups = self._groups(group_size) if group_size > 1 else [[e] for e in self._ready.values()]
        for group_id, group in enumerate(groups):
            if taken and (len(taken) + len(group) > max_rollouts or tokens >= token_budget):
                break
            for entry in group:
                taken.append(self._finish(entry, group_id if group_size > 1 else -1))
                tokens += len(entry.interaction.logprobs)
        return taken

    def drop_stale(self, min_version: int) -> int:
        """Drop ready interactions whose newest sampling version is below ``min_version``
        (counted as stale; later rewards for them are late). Returns how many."""
        stale = [e for e in self._ready.values() if e.interaction.policy_version < min_version]
        for entry in stale:
            del self._ready[entry.interaction.interaction_id]
            self._remember_finished(entry)
        self.counters.stale += len(stale)
        return len(stale)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_held_rewards(self) -> int:
        return len(self._held)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        def entry_state(e: _Entry) -> dict[str, Any]:
            return {"interaction": e.interaction.model_dump(mode="json"), "ts": e.ts,
                    "contributions": [_contribution_state(c) for c in e.contributions], "defaulted": e.defaulted}

        return {
            "watermark": self.watermark,
            "waiting": [entry_state(e) for e in self._waiting.values()],
            "ready": [entry_state(e) for e in self._ready.values()],
            "held": [[iid, [_contribution_state(c) for c in cs]] for iid, cs in self._held.items()],
            "finished": [[iid, t] for iid, t in self._finished.items()],
            "counters": asdict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def entry_from(s: dict[str, Any]) -> _Entry:
            return _Entry(Interaction.model_validate(s["interaction"]), s["ts"],
                          [_contribution_from(c) for c in s["contributions"]], s["defaulted"])

        self.watermark = state["watermark"]
        self._waiting = {e.interaction.interaction_id: e for e in map(entry_from, state["waiting"])}
        self._ready = OrderedDict((e.interaction.interaction_id, e) for e in map(entry_from, state["ready"]))
        self._held = OrderedDict((iid, [_contribution_from(c) for c in cs]) for iid, cs in state["held"])
        self._finished = OrderedDict((iid, t) for iid, t in state["finished"])
        self._deadlines = [(self._window_end(e), iid) for iid, e in self._waiting.items()]
        heapq.heapify(self._deadlines)
        known = {f.name for f in fields(JoinCounters)}
        self.counters = JoinCounters(**{k: v for k, v in state["counters"].items() if k in known})

    # -- internals -----------------------------------------------------------------------
    def _window_end(self, entry: _Entry) -> float:
        return entry.ts + self.cfg.window_s

    def _make_ready(self, entry: _Entry) -> None:
        if not entry.defaulted:
            self.counters.joined += 1
        self._ready[entry.interaction.interaction_id] = entry

    def _close(self, entry: _Entry) -> None:
        """The window of an interaction without rewards ended."""
        if self.cfg.on_missing == "default":
            self.counters.defaulted += 1
            entry.defaulted = True
            self._make_ready(entry)
        else:
            self.counters.dropped_no_reward += 1
            self._remember_finished(entry)

    def _evict_oldest_waiting(self) -> None:
        while self._deadlines:
            _, iid = heapq.heappop(self._deadlines)
            entry = self._waiting.pop(iid, None)
            if entry is not None:
                self.counters.evicted += 1
                self._remember_finished(entry)
                return

    def _remember_finished(self, entry: _Entry) -> None:
        if len(self._finished) >= self.max_pending:
            self._finished.popitem(last=False)
        self._finished[entry.interaction.interaction_id] = entry.ts + FINISHED_MEMORY_WINDOWS * self.cfg.window_s

    def _finish(self, entry: _Entry, group_id: int) -> JoinedInteraction:
        del self._ready[entry.interaction.interaction_id]
        self._remember_finished(entry)
        if entry.defaulted:
            reward, turns = self.cfg.default_value, {}
        else:
            mode = self.cfg.aggregation
            reward = aggregate([c.value for c in entry.contributions], mode)
            per_turn: dict[int, list[float]] = {}
            for c in entry.contributions:
                for turn, value in c.turns.items():
                    per_turn.setdefault(turn, []).append(value)
            turns = {turn: aggregate(values, mode) for turn, values in sorted(per_turn.items())}
        return JoinedInteraction(entry.interaction, reward, turns, not entry.defaulted, entry.ts, group_id)

    def _groups(self, group_size: int) -> list[list[_Entry]]:
        """Complete groups of ``group_size`` ready rollouts of one prompt, in order of
        their oldest member; an incomplete group keeps waiting."""
        by_prompt: dict[str, list[tuple[int, _Entry]]] = {}
        complete: list[list[tuple[int, _Entry]]] = []
        for position, entry in enumerate(self._ready.values()):
            members = by_prompt.setdefault(prompt_group_key(entry.interaction), [])
            members.append((position, entry))
            if len(members) == group_size:
                complete.append(list(members))
                members.clear()
        complete.sort(key=lambda group: group[0][0])
        return [[entry for _, entry in group] for group in complete]

    def _poppable(self, group_size: int) -> list[_Entry]:
        if group_size <= 1:
            return list(self._ready.values())
        return [e for group in self._groups(group_size) for e in group]


def _contribution_state(c: _Contribution) -> dict[str, Any]:
    return {"value": c.value, "turns": [[t, v] for t, v in c.turns.items()], "ts": c.ts}


def _contribution_from(s: dict[str, Any]) -> _Contribution:
    return _Contribution(s["value"], {int(t): v for t, v in s["turns"]}, s["ts"])
