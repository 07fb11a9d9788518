"""The data of the reward join (:mod:`trainer.join`): its counters, what an interaction
waiting in it holds, what it hands to a step, and the pure rules that combine rewards and
form grpo groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field

from online_sao.batch import Rollout
from online_sao.config import RewardConfig
from online_sao.schemas import Interaction, Reward
from trainer.rollouts import interaction_to_rollout, response_turns


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
    """Rewards for an interaction already trained on or dropped, stamped past its window, or read after
    it stopped waiting for rewards (:attr:`Entry.closed`; not applied)."""
    early_rewards: int = 0
    """Rewards read before their interaction (held, applied when it arrives)."""
    expired_rewards: int = 0
    """Held rewards whose interaction never arrived within the window."""
    duplicate_interactions: int = 0
    """Interaction ids seen a second time (ignored)."""
    excess_rewards: int = 0
    """Rewards past ``MAX_REWARDS_PER_INTERACTION`` for one interaction (not applied, not held)."""
    ignored_rewards: int = 0
    """Rewards from a source ``reward.sources`` leaves out (not applied)."""
    refused_on_resume: int = 0
    """Rewards a checkpoint's join buffer held that the learner's ``reward.*`` settings now refuse
    (outside a narrowed range, or from a source ``reward.sources`` no longer reads; not applied)."""
    missing_sources: int = 0
    """Interactions whose window closed before every source of ``reward.wait_for_sources`` rated
    them (trained on the rewards they had)."""
    duplicate_rewards: int = 0
    """Copies of a reward already joined (the same record read twice: a spool replay, a producer
    retry; ignored)."""
    evicted: int = 0
    """Waiting interactions or held rewards given up because the buffer was full (each reward given
    up counts, however many were held for one id)."""
    stale: int = 0
    """Ready interactions dropped for sampling versions older than the allowed lag."""
    superseded: int = 0
    """Interactions whose turns joined a continuation instead of training alone."""
    trained_turn_rewards: int = 0
    """Reward values for a turn already trained (not applied)."""
    misdirected_rewards: int = 0
    """Rewards sent to an absorbed interaction for a turn it does not have (not applied)."""
    forgotten_turns: int = 0
    """Turns of a continuation left as observations: their interaction is no longer in the id
    memory and the trajectory began before its floor, so they may have trained already."""
    expired_interactions: int = 0
    """Interactions created before the id memory's floor (refused: they could be copies)."""
    aborted: int = 0
    """Interactions whose answer was cut (``finish_reason`` abort) and so not trained as rollouts of
    their own (``reward.train_aborted`` off); a continuation may still train their turn."""
    complete_groups: int = 0
    """grpo groups handed out with all their members."""
    incomplete_groups: int = 0
    """grpo groups handed out short of members after ``reward.group_timeout_s``."""
    group_wait_s: float = 0.0
    """Record time summed over handed-out groups, from the first member being ready to the
    group being complete (or timed out)."""

    def metrics(self) -> dict[str, float]:
        return {f"join_{k}": float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Contribution:
    value: float
    turns: dict[int, float]
    ts: float
    origin: str | None = None
    """None: a reward for the entry's own id; else the absorbed interaction it was sent to."""
    scores: dict[str, float] = field(default_factory=dict)
    """The reward record's named scores (``Reward.scores``)."""
    key: str | None = None
    """The reward record's digest (:func:`reward_key`): a copy of it has the same (None in
    checkpoints from before it was kept)."""
    source: str | None = None
    """The reward record's ``source`` (None in checkpoints from before it was kept)."""


def reward_key(reward: Reward) -> str:
    """A digest of everything a reward record says: two copies of one record (a spool replay, a
    producer's retry) share it; two rewards, even of one value from one source, differ at least in
    ``created_at``."""
    return hashlib.sha256(reward.model_dump_json().encode()).hexdigest()[:32]


@dataclass
class Claim:
    """An ancestor whose turns a pending continuation holds."""

    anchor: float
    seen: bool
    """Its own record was read."""


@dataclass
class Entry:
    interaction: Interaction
    ts: float
    anchor: float
    contributions: list[Contribution] = field(default_factory=list)
    defaulted: bool = False
    claimed: dict[str, Claim] = field(default_factory=dict)
    ready_at: float = 0.0
    """The watermark when the entry became ready (grpo's group wait and timeout)."""
    closed: bool = False
    """It stopped waiting for rewards without every one it waits for (its window closed, or the
    buffer gave it up) and waits for a step: a reward read since is late, however it was stamped,
    so whether it applies does not hang on when the next step takes the entry."""

    @property
    def iid(self) -> str:
        return self.interaction.interaction_id

    @property
    def own_rewarded(self) -> bool:
        return any(c.origin is None for c in self.contributions)


@dataclass
class JoinedInteraction:
    """An interaction ready to train on, with its combined rewards."""

    interaction: Interaction
    reward: float | None
    """Final reward on the last token; None: none of its own (it trains on its ancestors' rewards)."""
    turn_rewards: dict[int, float]
    rewarded: bool
    """False when no reward for its own id arrived (the default one, or ancestors' only)."""
    timestamp: float
    group_id: int = -1
    observed_turns: frozenset[int] = frozenset()
    """Turns trained earlier: observations in this rollout."""
    scores: dict[str, float] = field(default_factory=dict)
    """Its own rewards' named scores, combined (:func:`combine_scores`); books only."""
    source_rewards: dict[str, float] = field(default_factory=dict)
    """Its own rewards by source, each source's combined (:func:`rewards_by_source`); books only."""
    defaulted: bool = False
    """``reward`` is ``reward.default_value``: its window closed with no reward of its own."""

    @property
    def num_action_tokens(self) -> int:
        """Action tokens it trains (those of observed turns are not)."""
        return trained_action_tokens(self.interaction, self.observed_turns)

    def to_rollout(self) -> Rollout:
        return interaction_to_rollout(self.interaction, self.reward, self.turn_rewards, self.group_id,
                                      self.observed_turns, self.scores, self.defaulted)


def trained_action_tokens(interaction: Interaction, observed_turns: Collection[int]) -> int:
    """Action tokens of ``interaction`` outside ``observed_turns`` (those turns train elsewhere)."""
    if not observed_turns:
        return len(interaction.logprobs)
    turns = response_turns(interaction)
    return sum(1 for index, is_action in enumerate(interaction.action_mask)
               if is_action and turns[index] not in observed_turns)


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


def last_turns(interaction: Interaction) -> dict[str, int]:
    """Origin id -> index of the last turn it sampled, for the record's other origins."""
    own = interaction.interaction_id
    return {o.interaction_id: k for k, o in enumerate(interaction.origins()) if o.interaction_id != own}


def combine_scores(entry: Entry, cfg: RewardConfig) -> dict[str, float]:
    """The named scores of a taken entry: for each name, the values its own rewards carried,
    combined by ``cfg.aggregation`` except that ``sum`` takes the mean (a score measures the
    answer, like a judge's quality in [0, 1]; two judges' readings do not add up)."""
    mode = "mean" if cfg.aggregation == "sum" else cfg.aggregation
    by_name: dict[str, list[float]] = {}
    for c in entry.contributions:
        if c.origin is None:
            for name, value in c.scores.items():
                by_name.setdefault(name, []).append(value)
    return {name: aggregate(values, mode) for name, values in sorted(by_name.items())}


def rewards_by_source(entry: Entry, cfg: RewardConfig) -> dict[str, float]:
    """A taken entry's own rewards, each source's combined by ``cfg.aggregation``: what each source
    said of the answer (trainer/source_rewards.py). Rewards kept before sources were (None) are left out."""
    by_source: dict[str, list[float]] = {}
    for c in entry.contributions:
        if c.origin is None and c.source is not None:
            by_source.setdefault(c.source, []).append(c.value)
    return {source: aggregate(values, cfg.aggregation) for source, values in sorted(by_source.items())}


def combine_rewards(entry: Entry, observed: set[int], cfg: RewardConfig) -> tuple[float | None, dict[int, float], int]:
    """The rewards of a taken entry: the final reward (its own rewards aggregated by
    ``cfg.aggregation``, or the default, or None), each turn's reward (its per-turn rewards
    aggregated, plus the aggregated final reward of the absorbed interaction whose last turn it
    is), and how many reward values fell on ``observed`` turns (trained earlier: not applied; each
    record's value counts, not the turn's aggregate)."""
    mode = cfg.aggregation
    own = [c.value for c in entry.contributions if c.origin is None]
    reward = aggregate(own, mode) if own else (cfg.default_value if entry.defaulted else None)
    per_turn: dict[int, list[float]] = {}
    finals: dict[str, list[float]] = {}
    for c in entry.contributions:
        for turn, value in c.turns.items():
            per_turn.setdefault(turn, []).append(value)
        if c.origin is not None:
            finals.setdefault(c.origin, []).append(c.value)
    turns = {turn: aggregate(values, mode) for turn, values in per_turn.items()}
    last = last_turns(entry.interaction)
    for origin, values in finals.items():
        turns[last[origin]] = turns.get(last[origin], 0.0) + aggregate(values, mode)
    applied = {turn: value for turn, value in sorted(turns.items()) if turn not in observed}
    dropped = sum(len(values) for turn, values in per_turn.items() if turn in observed)
    dropped += sum(len(values) for origin, values in finals.items() if last[origin] in observed)
    return reward, applied, dropped


def complete_groups(ready: Iterable[Entry], group_size: int, watermark: float | None = None,
                    timeout_s: float | None = None) -> list[list[Entry]]:
    """Groups of ``group_size`` ready rollouts of one prompt, and incomplete groups whose oldest
    member has waited past ``timeout_s`` (record time, up to ``watermark``), in order of their
    oldest member; other incomplete groups keep waiting."""
    by_prompt: dict[str, list[tuple[int, Entry]]] = {}
    groups: list[list[tuple[int, Entry]]] = []
    for position, entry in enumerate(ready):
        members = by_prompt.setdefault(prompt_group_key(entry.interaction), [])
        members.append((position, entry))
        if len(members) == group_size:
            groups.append(list(members))
            members.clear()
    if timeout_s is not None and watermark is not None:
        groups += [members for members in by_prompt.values()
                   if members and watermark - min(e.ready_at for _, e in members) > timeout_s]
    groups.sort(key=lambda group: group[0][0])
    return [[entry for _, entry in group] for group in groups]
