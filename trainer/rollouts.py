"""Turn a logged interaction and its joined rewards into a :class:`~online_sao.batch.Rollout`.

Layout (the token alignment of :mod:`online_sao.batch`): the trajectory is
``prompt_ids + response_ids``; the action mask is False over the prompt and the
interaction's own mask over the response; behaviour log-probs and versions,
which the record holds for action tokens only, are spread onto the action
positions (0 elsewhere).

Reward placement (SAO.md section 2): the final reward sits on the last token of
the trajectory, each per-turn reward on the last token of its turn
(``turn_ends``). When such a token is not an action (a trajectory ending in a
tool result, say), GAE credits the reward to the last action token before it.
Two rewards on one token add up.
"""

from __future__ import annotations

from collections.abc import Mapping

from online_sao.batch import Rollout
from online_sao.schemas import Interaction


class RolloutError(ValueError):
    """A joined interaction that cannot become a rollout; the message says why."""


def interaction_to_rollout(interaction: Interaction, reward: float,
                           turn_rewards: Mapping[int, float] | None = None, group_id: int = -1) -> Rollout:
    """The rollout of ``interaction`` with its final ``reward`` and ``turn_rewards``
    (assistant turn index -> value). Raises RolloutError for a turn the
    interaction does not have."""
    prompt_len = len(interaction.prompt_ids)
    token_ids = list(interaction.prompt_ids) + list(interaction.response_ids)
    action_mask = [False] * prompt_len + list(interaction.action_mask)
    logprobs = [0.0] * len(token_ids)
    versions = [0] * len(token_ids)
    actions = (i for i, is_action in enumerate(action_mask) if is_action)
    for position, logprob, version in zip(actions, interaction.logprobs, interaction.versions, strict=True):
        logprobs[position] = logprob
        versions[position] = version

    rewards: dict[int, float] = {len(token_ids) - 1: float(reward)}
    for turn, value in (turn_rewards or {}).items():
        if not 0 <= turn < len(interaction.turn_ends):
            raise RolloutError(f"interaction {interaction.interaction_id}: reward for turn {turn}, "
                               f"but it has {len(interaction.turn_ends)} turns")
        position = prompt_len + interaction.turn_ends[turn]
        rewards[position] = rewards.get(position, 0.0) + float(value)

    return Rollout(
        interaction_id=interaction.interaction_id,
        token_ids=token_ids,
        action_mask=action_mask,
        logprobs=logprobs,
        versions=versions,
        rewards=rewards,
        temperature=interaction.sampling.temperature,
        group_id=group_id,
    )
