"""What the join could hand out now, and in which units (a mixin of :class:`trainer.join.RewardJoiner`):
rollouts, or grpo groups of one prompt, complete or given up as incomplete (the rules in
:mod:`trainer.join`'s docstring). The feed decides from these counts whether a step can start and
whether to keep reading (trainer/feed.py)."""

from __future__ import annotations

from collections import OrderedDict

from online_sao.config import RewardConfig
from trainer.join_state import Entry, JoinCounters, complete_groups, prompt_group_key, trained_action_tokens
from trainer.join_trajectories import TrajectoryRules


class ReadyUnits(TrajectoryRules):
    """Counts of what is ready, and the grpo grouping :meth:`~trainer.join.RewardJoiner.pop_ready` hands
    out by. Works on the state of :class:`trainer.join.RewardJoiner`, which it is a base of (these
    attributes)."""

    cfg: RewardConfig
    max_pending: int
    watermark: float | None
    counters: JoinCounters
    _ready: OrderedDict[str, Entry]

    def ready_rollouts(self, group_size: int = 1) -> int:
        """Rollouts :meth:`pop_ready` could hand out now (:meth:`ready_stats` without the tokens)."""
        units, _, _ = self._ready_pass(group_size)
        return sum(len(unit) for unit in units)

    def ready_units(self, group_size: int = 1) -> int:
        """What :meth:`pop_ready` could hand out now, in the units a step shares among ranks: rollouts,
        or grpo groups when ``group_size > 1`` (complete ones, and incomplete ones past
        ``reward.group_timeout_s``; each goes whole to one rank); only those with action tokens to train."""
        _, trainable, _ = self._ready_pass(group_size)
        return trainable

    def ready_stats(self, group_size: int = 1) -> tuple[int, int]:
        """(rollouts, action tokens) that :meth:`pop_ready` could hand out now."""
        _, rollouts, tokens = self.ready_counts(group_size)
        return rollouts, tokens

    def ready_counts(self, group_size: int = 1) -> tuple[int, int, int]:
        """(:meth:`ready_units`, rollouts, action tokens) in one pass over what is ready."""
        units, trainable, tokens = self._ready_pass(group_size)
        return trainable, sum(len(unit) for unit in units), tokens

    def _ready_pass(self, group_size: int) -> tuple[list[list[Entry]], int, int]:
        """The units (rollouts, or grpo groups) :meth:`pop_ready` would hand out now if nothing
        stopped it, how many of them have action tokens to train, and their action tokens; no side
        effects. A ready answer whose turn a continuation earlier in the pass trains is absorbed by
        it (:meth:`_train_turns`) and handed out by no one; one whose every action token is of a turn
        trained before trains nothing. Counted as units, a multi-rank step could count a unit for a
        rank that would get none and drop the step's rollouts (trainer/feed.py)."""
        units: list[list[Entry]] = []
        trained: set[str] = set()  # ids whose turns an entry before trains
        tokens = trainable = 0
        ready = list(self._ready.values())
        for group in self._groups(ready, group_size) if group_size > 1 else [[e] for e in ready]:
            unit, unit_tokens = [], 0
            for entry in group:  # in the order pop_ready takes them: earlier ones train first
                if entry.iid in trained:
                    continue
                observed = self._trained_turns(entry, trained)
                unit_tokens += trained_action_tokens(entry.interaction, observed)
                trained.update(origin.interaction_id for turn, origin in enumerate(entry.interaction.origins())
                               if turn not in observed)
                unit.append(entry)
            if unit:
                units.append(unit)
            tokens += unit_tokens
            trainable += unit_tokens > 0
        return units, trainable, tokens

    def _groups(self, ready: list[Entry], group_size: int) -> list[list[Entry]]:
        """The grpo units :meth:`pop_ready` hands out, in order of their oldest member: complete groups,
        incomplete ones past ``reward.group_timeout_s``, and, while more than ``max_pending`` members of
        incomplete groups are held, the oldest incomplete groups (:meth:`_overflowing_groups`)."""
        groups = complete_groups(ready, group_size, self.watermark, self.cfg.group_timeout_s)
        held = len(ready) - sum(len(group) for group in groups)
        if held <= self.max_pending:
            return groups
        return self._overflowing_groups(ready, groups, held - self.max_pending)

    def _overflowing_groups(self, ready: list[Entry], groups: list[list[Entry]], excess: int) -> list[list[Entry]]:
        """``groups`` and, oldest first, incomplete groups of at least ``excess`` members in all, handed
        out as they are (counted as incomplete, as a timeout would). The feed's backpressure counts only
        what pop_ready could hand out: with unique prompts and no group timeout (or a long one) the
        members of incomplete groups grew without bound, each readiness check scanning them all.
        Pausing the feed instead would wait for good on groups that only more records complete."""
        grouped = {entry.iid for group in groups for entry in group}
        position = {entry.iid: at for at, entry in enumerate(ready)}
        incomplete: dict[str, list[Entry]] = {}
        for entry in ready:  # in ready order: each group's first member is its oldest
            if entry.iid not in grouped:
                incomplete.setdefault(prompt_group_key(entry.interaction), []).append(entry)
        given_up = []
        for group in incomplete.values():  # dicts keep insertion order: oldest first member first
            if excess <= 0:
                break
            given_up.append(group)
            excess -= len(group)
        return sorted([*groups, *given_up], key=lambda group: position[group[0].iid])

    def _count_group(self, group: list[Entry], group_size: int) -> None:
        first = min(e.ready_at for e in group)
        if len(group) == group_size:
            self.counters.complete_groups += 1
            self.counters.group_wait_s += max(e.ready_at for e in group) - first
        else:
            self.counters.incomplete_groups += 1
            self.counters.group_wait_s += self.cfg.group_timeout_s or 0.0
