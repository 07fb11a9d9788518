"""Which rewards are accepted and how they are joined to their interactions."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field, model_validator

from online_sao.config.base import Section
from online_sao.schemas import MAX_ABS_REWARD


DEFAULT_ID_MEMORY_S = 86_400.0
"""Default of reward.memory_s: a day covers any broker or serving outage an operator lets run
before intervening, at the size of a day's ids (bounded anyway by the join's max_pending)."""


class RewardConfig(Section):
    min_value: float = Field(-10.0, ge=-MAX_ABS_REWARD)
    """Smallest reward accepted: serving's feedback endpoint refuses one below it (422), and the
    learner dead-letters a reward record below it (its value or a turn's) untrained, whoever
    produced it; no lower than the records allow (-1e6)."""
    max_value: float = Field(10.0, le=MAX_ABS_REWARD)
    """Largest reward accepted (422 above; the learner dead-letters a reward record above it, as
    below ``min_value``); no higher than the records allow (1e6)."""
    window_s: float = Field(300.0, gt=0)
    """How long after an interaction a reward is accepted and joined."""
    aggregation: Literal["first", "last", "sum", "mean"] = "last"
    """How several rewards for one interaction combine."""
    on_missing: Literal["default", "drop"] = "drop"
    """What happens to an interaction whose window closes without a reward."""
    default_value: float = 0.0
    """Reward given when on_missing is 'default'; within [min_value, max_value], like any reward accepted."""
    group_timeout_s: float | None = Field(30.0, gt=0)
    """grpo: how long (record time) the oldest ready member of an incomplete group waits for the
    rest; then the group is trained on as it is and counted (``join_incomplete_groups``), a unit
    of a step like a complete group (alone, a step of one process). A group whose member lost its
    reward would otherwise never complete. None: no timeout; an incomplete group then waits until
    more than ``trainer.join_max_pending`` members of incomplete groups are held, when the oldest is
    handed out as it is (counted the same)."""
    train_aborted: bool = False
    """Whether an interaction whose answer was cut (``finish_reason`` ``abort``: its client left, or
    serving's deadline or shutdown ended it) is trained as a rollout of its own. Off: it is not
    (counted as join_aborted, its rewards not applied), because its last token is where something
    outside the policy stopped it, not an end the policy chose, and a reward of the cut text (a
    judge's, or the default) would be credited to the answer's start as if it were the whole answer.
    Either way, a continuation that carries its turn in its history trains it as one of its turns
    (the trajectory goes on past it)."""
    sources: list[str] | None = None
    """The reward sources (``Reward.source``: ``user`` unless ``/v1/feedback`` names another, ``judge``
    for the experiments' judge) whose rewards the learner trains on; a reward from any other source is
    counted (``join_ignored_rewards``) and not applied (it stays on the rewards topic). None: every
    source."""
    wait_for_sources: list[str] = []
    """Sources an interaction waits for: it is ready for a step once each of them rated it, or when
    its window closes with only some of them (then it trains on the rewards it has, counted as
    ``join_missing_sources``), so that their rewards combine by ``aggregation``. Empty: ready at its
    first reward; a reward arriving after a step took the interaction is late and not applied, so with
    several sources the first to rate an interaction is usually the only one trained on. List the
    sources that rate every answer (a judge, an environment): an answer waits for a listed source that
    skips it until its window closes (``window_s``)."""
    revision: str = Field("", max_length=200)
    """What the rewards mean outside this config: the judge's prompt or model, the rating scale users
    see. Change it when that changes: the gate compares a candidate with the champion's record (its
    reward measured earlier, docs/DEPLOY.md) only if the record was measured under the same
    revision and the same settings here (``RewardConfig.definition``)."""
    memory_s: float | None = Field(None, gt=0)
    """How long after its creation the learner remembers an interaction id (trainer/id_memory.py).
    An interaction first read later than that is refused (counted as join_expired_interactions), so
    none is ever trained twice, whenever a copy is replayed. None: one day, or two reward windows if
    longer. At least two reward windows (a late reward must still be recognised as late)."""

    @model_validator(mode="after")
    def _range(self) -> "RewardConfig":
        if not self.min_value < self.max_value:
            raise ValueError("min_value must be below max_value")
        if not self.min_value <= self.default_value <= self.max_value:  # NaN fails too
            raise ValueError(f"default_value ({self.default_value:g}) must lie within min_value and max_value "
                             f"({self.min_value:g} to {self.max_value:g}): the learner trains on it as a reward")
        if self.sources == []:
            raise ValueError("sources [] would apply no reward at all (every one counted as ignored): leave it "
                             "unset to train on every source")
        if len(set(self.wait_for_sources)) < len(self.wait_for_sources):
            raise ValueError(f"wait_for_sources {self.wait_for_sources} names a source twice")
        unheard = [s for s in self.wait_for_sources if self.sources is not None and s not in self.sources]
        if unheard:
            raise ValueError(f"wait_for_sources names {unheard}, which sources ({self.sources}) leaves out: "
                             "an interaction would wait for rewards that are never applied")
        if self.memory_s is not None and self.memory_s < 2 * self.window_s:
            raise ValueError(f"memory_s ({self.memory_s:g}) must be at least two reward windows "
                             f"(2 x window_s = {2 * self.window_s:g})")
        return self

    def definition(self) -> str:
        """A digest (16 hex digits) of what sets a trained reward's value: the settings above that
        choose and combine rewards (``sources``, ``wait_for_sources``, ``aggregation``, ``on_missing``,
        ``default_value`` where it is used, the accepted range) and ``revision``. Rewards are on one
        scale only if their definitions are equal. Timing settings (windows, memory) are left out:
        they change which rewards arrive in time, not what one means."""
        fields = {"sources": sorted(self.sources) if self.sources is not None else None,
                  "wait_for_sources": sorted(self.wait_for_sources), "aggregation": self.aggregation,
                  "on_missing": self.on_missing,
                  "default_value": self.default_value if self.on_missing == "default" else None,
                  "min_value": self.min_value, "max_value": self.max_value, "revision": self.revision}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def id_memory_s(self) -> float:
        """``memory_s``, or its default when None."""
        return self.memory_s if self.memory_s is not None else max(DEFAULT_ID_MEMORY_S, 2 * self.window_s)
