"""Record builders shared by the trainer tests (a helper module, not a conftest)."""

from __future__ import annotations

from online_sao.schemas import Interaction, Reward, SamplingParams, TurnReward


def make_interaction(iid: str, prompt=(5, 6, 7), response=(8, 9, 10), mask=None, logprobs=None,
                     version: int = 0, turn_ends=(), temperature: float = 1.0) -> Interaction:
    mask = [True] * len(response) if mask is None else list(mask)
    actions = sum(mask)
    logprobs = [-0.5 - 0.1 * i for i in range(actions)] if logprobs is None else list(logprobs)
    return Interaction(
        interaction_id=iid, model="tiny", prompt_ids=list(prompt), response_ids=list(response),
        action_mask=mask, logprobs=logprobs, versions=[version] * actions, turn_ends=list(turn_ends),
        sampling=SamplingParams(temperature=temperature), created_at=0.0, completed_at=0.0,
    )


def make_reward(iid: str, value: float, turns: dict[int, float] | None = None) -> Reward:
    return Reward(interaction_id=iid, value=value, created_at=0.0,
                  turn_rewards=[TurnReward(turn=t, value=v) for t, v in (turns or {}).items()])

