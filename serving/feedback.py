"""POST /v1/feedback: validate a reward for an interaction this deployment issued, and log it.

Refused, with nothing logged: an id this deployment did not sign (403), a ``source``
outside ``serving.feedback_sources`` when that is set, or one ``serving.source_keys`` binds to
keys the caller's is not among (403), an id
older than the reward window (410), a reward or per-turn reward that is not
finite or outside ``[reward.min_value, reward.max_value]`` (422), a turn index
beyond the trajectory's assistant turns when the trajectory is still held (422).
An accepted reward is answered 200 only once the logger says it is durable
(``serving.log_durability``); 503 if that takes longer than ``ack_timeout_s``.
"""

from __future__ import annotations

from online_sao.config import RewardConfig
from online_sao.schemas import Reward, TurnReward
from serving.ids import InteractionIdError, InteractionIdSigner
from serving.interaction_log import InteractionLogger
from serving.errors import APIError, logging_unavailable
from serving.service_models import FeedbackRequest, FeedbackResponse
from serving.trajectories import TrajectoryCache


class FeedbackService:
    def __init__(self, signer: InteractionIdSigner, logger: InteractionLogger, cfg: RewardConfig,
                 trajectories: TrajectoryCache, ack_timeout_s: float = 10.0,
                 allowed_sources: list[str] | None = None, source_callers: dict[str, frozenset[str]] | None = None):
        self.ack_timeout_s = ack_timeout_s
        self.allowed_sources = allowed_sources
        self.source_callers = source_callers or {}
        """Source -> names of the API keys that alone may claim it (``auth.key_name``)."""
        self.signer = signer
        self.logger = logger
        self.cfg = cfg
        self.trajectories = trajectories

    def _in_range(self, value: float, param: str) -> None:
        if not self.cfg.min_value <= value <= self.cfg.max_value:
            raise APIError(422, f"{param} {value} is outside the accepted range "
                                f"[{self.cfg.min_value}, {self.cfg.max_value}]", param=param,
                           code="reward_out_of_range")

    async def submit(self, request: FeedbackRequest, caller: str | None = None) -> FeedbackResponse:
        """Validate and log ``request``; ``caller``: the name ``ApiKeyAuth.check`` gave the request."""
        try:
            self.signer.verify(request.interaction_id)
        except InteractionIdError as exc:
            raise APIError(exc.status, exc.message, param="interaction_id", code=exc.code) from None
        if self.allowed_sources is not None and request.source not in self.allowed_sources:
            raise APIError(403, f"source {request.source!r} may not be claimed here (serving.feedback_sources: "
                                f"{', '.join(self.allowed_sources) or 'none'})", param="source",
                           code="source_not_allowed")
        owners = self.source_callers.get(request.source)
        if owners is not None and caller not in owners:
            raise APIError(403, f"source {request.source!r} may be claimed only with its own API keys "
                                "(serving.source_keys)", param="source", code="source_not_allowed")
        self._in_range(request.reward, "reward")
        seen: set[int] = set()
        for i, turn in enumerate(request.turn_rewards):
            self._in_range(turn.value, f"turn_rewards[{i}].value")
            if turn.turn in seen:
                raise APIError(422, f"turn_rewards[{i}] names turn {turn.turn} again: one reward per turn",
                               param=f"turn_rewards[{i}].turn", code="duplicate_turn")
            seen.add(turn.turn)
        known = self.trajectories.get(request.interaction_id)
        if known is not None:
            turns = len(known.record.turn_ends)
            for i, turn in enumerate(request.turn_rewards):
                if turn.turn >= turns:
                    raise APIError(422, f"turn_rewards[{i}].turn is {turn.turn} but the interaction has "
                                        f"{turns} assistant turn(s)", param=f"turn_rewards[{i}].turn",
                                   code="turn_out_of_range")
        reason = self.logger.refusal()
        if reason is not None:
            raise logging_unavailable(reason)
        receipt = self.logger.submit(Reward(interaction_id=request.interaction_id, value=request.reward,
                                            source=request.source,
                                            turn_rewards=[TurnReward(turn=t.turn, value=t.value)
                                                          for t in request.turn_rewards],
                                            scores=request.scores))
        if not await receipt.wait_async(self.ack_timeout_s):
            raise logging_unavailable(f"the reward could not be logged within {self.ack_timeout_s:g} s "
                                      f"(serving.log_ack_timeout_s): {self.logger.refusal() or 'the log is behind'}")
        return FeedbackResponse(interaction_id=request.interaction_id)
