"""Turn a logged interaction and its joined rewards into a :class:`~online_sao.batch.Rollout`.

Layout (the token alignment of :mod:`online_sao.batch`): the trajectory is
``prompt_ids + response_ids``; the action mask is False over the prompt and the
interaction's own mask over the response; behaviour log-probs and versions,
which the record holds for action tokens only, are spread onto the action
positions (0 elsewhere). Each action token carries the temperature and top_p of
the turn that sampled it (:meth:`~online_sao.schemas.Interaction.origins`), so
the learner recomputes its log-probability under the distribution it really
came from.

Turns already trained as part of an earlier rollout (``observed_turns``, decided
by the join: docs/ALGORITHM.md, "Multi-turn trajectories") stay in the trajectory
as observations: their tokens are context, not actions, and train nothing again.

Reward placement (SAO.md section 2): the final reward sits on the last token of
the trajectory, each per-turn reward on the last token of its turn
(``turn_ends``). When such a token is not an action (a trajectory ending in a
tool result, say), GAE credits the reward to the last action token before it.
Two rewards on one token add up.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from online_sao.batch import Rollout
from online_sao.schemas import Interaction

if TYPE_CHECKING:
    from trainer.join_state import JoinedInteraction

log = logging.getLogger(__name__)


class RolloutError(ValueError):
    """A joined interaction that cannot become a rollout; the message says why."""


def response_turns(interaction: Interaction) -> list[int | None]:
    """For each response token, the index of the assistant turn it belongs to (turn k
    spans the tokens after turn k - 1's last one up to its own last one); None after
    the last turn."""
    turns: list[int | None] = []
    start = 0
    for turn, end in enumerate(interaction.turn_ends):
        turns.extend([turn] * (end + 1 - start))
        start = end + 1
    return turns + [None] * (len(interaction.response_ids) - start)


def interaction_to_rollout(interaction: Interaction, reward: float | None,
                           turn_rewards: Mapping[int, float] | None = None, group_id: int = -1,
                           observed_turns: Collection[int] = (),
                           scores: Mapping[str, float] | None = None, defaulted: bool = False) -> Rollout:
    """The rollout of ``interaction`` with its final ``reward`` (None: no reward on the
    last token) and ``turn_rewards`` (assistant turn index -> value); the action tokens
    of ``observed_turns`` become observations; ``scores`` are its rewards' named scores
    (books); ``defaulted``: ``reward`` is the join's default (``Rollout.defaulted``).
    Raises RolloutError for a turn the interaction does not have."""
    prompt_len = len(interaction.prompt_ids)
    token_ids = list(interaction.prompt_ids) + list(interaction.response_ids)
    n = len(token_ids)
    action_mask, logprobs, versions = [False] * n, [0.0] * n, [0] * n
    temperatures, top_ps = [1.0] * n, [1.0] * n
    origins = interaction.origins()
    own = interaction.sampling
    actions = (i for i, is_action in enumerate(interaction.action_mask) if is_action)
    turns = response_turns(interaction)
    for index, logprob, version in zip(actions, interaction.logprobs, interaction.versions, strict=True):
        turn = turns[index]
        if turn in observed_turns:
            continue
        position = prompt_len + index
        action_mask[position], logprobs[position], versions[position] = True, logprob, version
        setting = origins[turn] if turn is not None else own
        temperatures[position], top_ps[position] = setting.temperature, setting.top_p

    own_id = interaction.interaction_id
    turns_of = list(dict.fromkeys(origin.interaction_id for turn, origin in enumerate(origins)  # trained here
                                  if turn not in observed_turns and origin.interaction_id != own_id))
    rewards: dict[int, float] = {} if reward is None else {n - 1: float(reward)}
    for turn, value in (turn_rewards or {}).items():
        if not 0 <= turn < len(interaction.turn_ends):
            raise RolloutError(f"interaction {interaction.interaction_id}: reward for turn {turn}, "
                               f"but it has {len(interaction.turn_ends)} turns")
        position = prompt_len + interaction.turn_ends[turn]
        rewards[position] = rewards.get(position, 0.0) + float(value)

    return Rollout(interaction_id=interaction.interaction_id, token_ids=token_ids, action_mask=action_mask,
                   logprobs=logprobs, versions=versions, rewards=rewards, temperatures=temperatures,
                   top_ps=top_ps, group_id=group_id, segment=interaction.segment,
                   completed_at=interaction.completed_at,
                   scores=dict(scores or {}), defaulted=defaulted, turns_of=turns_of)


def to_rollouts(taken: list[JoinedInteraction], counters: dict[str, float], vocab_size: int) -> list[Rollout]:
    """Rollouts of the joined interactions; unusable ones are counted and left out (a token id
    outside the model's vocabulary passes the record codec, which does not know the model)."""
    rollouts = []
    for joined in taken:
        try:
            rollout = joined.to_rollout()
            if max(rollout.token_ids, default=0) >= vocab_size:
                raise RolloutError(f"interaction {rollout.interaction_id}: token id {max(rollout.token_ids)} "
                                   f"outside the model's vocabulary ({vocab_size})")
        except RolloutError as exc:
            counters["invalid_rollouts"] += 1
            log.warning("interaction not trained on: %s", exc)
            continue
        if rollout.num_action_tokens == 0:
            counters["empty_rollouts"] += 1
            continue
        rollouts.append(rollout)
    return rollouts
