"""Record builders shared by the trainer tests (a helper module, not a conftest)."""

from __future__ import annotations

from online_sao.config import RewardConfig
from online_sao.schemas import Interaction, Reward, SamplingParams, TurnReward
from serving.trajectories import TrajectoryPrefix
from trainer.join import RewardJoiner


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


def parent_ready_beside_its_continuation(cfg: RewardConfig) -> RewardJoiner:
    """A join (``cfg``: a 10 s window, ``on_missing: drop``) where c1 and c2 continue p; c1 claimed p
    but was dropped unrated when c2's reward, 10 s on, closed its window, so p, read last with its
    reward, is ready beside c2, which trains p's turn when taken."""
    p, c1 = conversation(["p", "c1"])
    _, c2 = conversation(["p", "c2"])
    j = RewardJoiner(cfg, max_pending=100)
    j.add_interaction(c1, ts=0.5)  # p not read yet: c1 claims it
    j.add_interaction(c2, ts=1.0)
    j.add_reward(make_reward("c2", 1.0), ts=1.0 + cfg.window_s)  # c1's window closes unrated: dropped
    j.add_reward(make_reward("p", 0.25), ts=1.0)  # held for p
    j.add_interaction(p, ts=1.0)
    return j
