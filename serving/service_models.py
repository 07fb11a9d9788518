"""Wire models of this service's own routes: ``POST /v1/feedback`` and the model list (``/v1/models``)
(the OpenAI-compatible requests: :mod:`serving.protocol`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from online_sao.schemas import MAX_SCORES_PER_REWARD, FiniteFloat, RewardValue, ScoreName


class TurnRewardIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)  # as the OpenAI requests' models
    turn: int = Field(ge=0)
    """Index of the assistant turn in the trajectory (0 = first)."""
    value: FiniteFloat


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    interaction_id: str = Field(min_length=1, max_length=256)
    reward: FiniteFloat
    source: str = Field("user", min_length=1, max_length=128)
    turn_rewards: list[TurnRewardIn] = []
    scores: dict[ScoreName, RewardValue] | None = Field(None, max_length=MAX_SCORES_PER_REWARD)
    """Named measurements behind the reward (``quality``, say), kept on the reward record for the
    learner's monitors and per-segment metrics; names of lower-case letters, digits and ``_``."""


# ----------------------------------------------------------------------------- answers

class FeedbackResponse(BaseModel):
    object: Literal["feedback"] = "feedback"
    interaction_id: str
    status: Literal["accepted"] = "accepted"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "online-sao"
    policy_version: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
