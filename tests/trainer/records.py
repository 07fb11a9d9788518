"""Record builders shared by the trainer tests (a helper module, not a conftest)."""

from __future__ import annotations

from online_sao.schemas import Interaction, Reward, SamplingParams, TurnReward
from serving.trajectories import TrajectoryPrefix


def make_interaction(iid: str, prompt=(5, 6, 7), response=(8, 9, 10), mask=None, logprobs=None,
                     version: int = 0, turn_ends=(), temperature: float = 1.0,
                     created_at: float = 0.0) -> Interaction:
    mask = [True] * len(response) if mask is None else list(mask)
    actions = sum(mask)
    logprobs = [-0.5 - 0.1 * i for i in range(actions)] if logprobs is None else list(logprobs)
    return Interaction(
        interaction_id=iid, model="tiny", prompt_ids=list(prompt), response_ids=list(response),
        action_mask=mask, logprobs=logprobs, versions=[version] * actions, turn_ends=list(turn_ends),
        sampling=SamplingParams(temperature=temperature), created_at=created_at, completed_at=created_at,
    )


def make_reward(iid: str, value: float, turns: dict[int, float] | None = None,
                scores: dict[str, float] | None = None, source: str = "user") -> Reward:
    return Reward(interaction_id=iid, value=value, created_at=0.0, source=source,
                  turn_rewards=[TurnReward(turn=t, value=v) for t, v in (turns or {}).items()], scores=scores)


def conversation(ids: list[str], prompt=(5, 6, 7), tokens_per_turn: int = 2,
                 observation=(3,)) -> list[Interaction]:
    """The records serving logs for one conversation of ``len(ids)`` requests, each continuing the
    previous one (built by serving's own TrajectoryPrefix): request k samples ``tokens_per_turn``
    tokens 100 * (k + 1) + j with log-prob -0.1 * (k + 1), and ``observation`` tokens (the
    user's next message) come between turns."""
    records: list[Interaction] = []
    prefix = TrajectoryPrefix(list(prompt))
    for k, iid in enumerate(ids):
        if records:
            prefix = TrajectoryPrefix.continuing(records[-1], list(observation))
        sampled = [100 * (k + 1) + j for j in range(tokens_per_turn)]
        fields = prefix.extended(iid, SamplingParams(), sampled, [-0.1 * (k + 1)] * tokens_per_turn,
                                 [0] * tokens_per_turn)
        records.append(Interaction(interaction_id=iid, model="tiny", **fields))
    return records
