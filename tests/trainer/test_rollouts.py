"""Interaction + joined rewards -> Rollout, and on through collate and GAE."""

from __future__ import annotations

import pytest
import torch

from online_sao.advantages import skip_observation_gae
from online_sao.batch import collate
from trainer.rollouts import RolloutError, interaction_to_rollout
from tests.trainer.records import make_interaction


def test_single_turn_layout():
    inter = make_interaction("a", prompt=(1, 2), response=(3, 4, 5), logprobs=[-0.1, -0.2, -0.3], version=7,
                             temperature=0.7)
    r = interaction_to_rollout(inter, reward=2.5)
    assert r.token_ids == [1, 2, 3, 4, 5]
    assert r.action_mask == [False, False, True, True, True]
    assert r.logprobs == [0.0, 0.0, -0.1, -0.2, -0.3]
    assert r.versions == [0, 0, 7, 7, 7]
    assert r.rewards == {4: 2.5}
    assert r.temperatures == [1.0, 1.0, 0.7, 0.7, 0.7] and r.top_ps == [1.0] * 5
    assert r.interaction_id == "a"


def test_multi_turn_observation_tokens_and_turn_rewards():
    # response: assistant [10, 11], tool [12, 13], assistant [14]; turns end at 1 and 4
    inter = make_interaction("m", prompt=(1,), response=(10, 11, 12, 13, 14),
                             mask=[True, True, False, False, True], logprobs=[-1.0, -2.0, -3.0],
                             turn_ends=(1, 4))
    r = interaction_to_rollout(inter, reward=1.0, turn_rewards={0: 0.25, 1: 0.5})
    assert r.action_mask == [False, True, True, False, False, True]
    assert r.logprobs == [0.0, -1.0, -2.0, 0.0, 0.0, -3.0]
    # turn 0 ends at response index 1 -> token 2; turn 1 ends on the last token, adding to the final reward
    assert r.rewards == {2: 0.25, 5: 1.5}


def test_final_reward_on_trailing_observation_is_credited_to_last_action():
    inter = make_interaction("o", prompt=(1,), response=(10, 11, 12), mask=[True, True, False],
                             logprobs=[-1.0, -1.0])
    r = interaction_to_rollout(inter, reward=3.0)
    assert r.rewards == {3: 3.0}  # on the observation token that ends the trajectory
    batch = collate([r], pad_token_id=0)
    adv, _ = skip_observation_gae(batch.rewards, torch.zeros_like(batch.rewards), batch.action_mask, 1.0, 1.0)
    assert adv[0].tolist() == [0.0, 3.0, 3.0, 0.0]


def test_unknown_turn_is_refused():
    inter = make_interaction("t", turn_ends=(2,))
    with pytest.raises(RolloutError, match="turn 1"):
        interaction_to_rollout(inter, reward=0.0, turn_rewards={1: 1.0})


def test_response_without_actions_still_places_the_reward():
    inter = make_interaction("e", prompt=(1, 2), response=(), mask=[], logprobs=[])
    r = interaction_to_rollout(inter, reward=1.0)
    assert r.num_action_tokens == 0 and r.rewards == {1: 1.0}
