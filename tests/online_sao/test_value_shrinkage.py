"""The critic's values shrunk toward, or levelled at, a running mean: the slope and the level by hand,
the window, SAO's use of them."""

import math

import pytest
import torch

from online_sao.advantages import length_adaptive_lambda, skip_observation_gae
from online_sao.config import AlgorithmConfig
from online_sao.value_shrinkage import (MIN_ROLLOUTS, ShrinkageWindow, anchor_level, rollout_sums, shrink,
                                       shrinkage_factor)
from tests.online_sao.test_sao import make_batch, make_sao


def _one_token_rollouts(values: list[float], rewards: list[float]) -> torch.Tensor:
    """Rows of rollouts with one action token each, whose return is their reward."""
    v = torch.tensor(values)[:, None]
    r = torch.tensor(rewards)[:, None]
    return rollout_sums(v, r, r, torch.ones_like(v, dtype=torch.bool))


def test_rollout_sums_by_hand():
    values = torch.tensor([[9.0, 0.5, 1.0], [0.2, 0.4, 7.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0], [0.5, 0.5, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[False, True, True], [True, True, False]])
    rows = rollout_sums(values, returns, rewards, mask)
    # count, reward, tokens, sum V, sum G, sum VG, sum V^2 (the masked 9 and 7 never count)
    assert rows[0].tolist() == pytest.approx([1, 1.0, 2, 1.5, 2.0, 1.5, 1.25])
    assert rows[1].tolist() == pytest.approx([1, 0.5, 2, 0.6, 1.0, 0.3, 0.2])


def test_the_slope_of_returns_on_values_around_the_mean():
    # eight rollouts: values 0 and 1 in turn, rewards 0.25 and 0.75: m = 0.5,
    # sum (V - m)(G - m) = 8 x 0.5 x 0.25 = 1, sum (V - m)^2 = 8 x 0.25 = 2 -> alpha 0.5
    rows = _one_token_rollouts([0.0, 1.0] * 4, [0.25, 0.75] * 4)
    m, alpha = shrinkage_factor(rows.sum(dim=0))
    assert (m, alpha) == pytest.approx((0.5, 0.5))


def test_the_slope_is_clamped_to_zero_and_one():
    # a critic that ranks the answers the wrong way round: negative slope -> 0
    _, against = shrinkage_factor(_one_token_rollouts([0.6, 0.4] * 4, [0.0, 1.0] * 4).sum(dim=0))
    # a timid critic (values 0.2 / 0.8 for returns 0 / 1): slope 0.5 / 0.3 -> 1
    _, timid = shrinkage_factor(_one_token_rollouts([0.2, 0.8] * 4, [0.0, 1.0] * 4).sum(dim=0))
    assert (against, timid) == (0.0, 1.0)


def test_too_few_rollouts_or_values_without_spread_give_alpha_zero():
    few = _one_token_rollouts([0.0, 1.0] * 3, [0.25, 0.75] * 3)  # 6 < MIN_ROLLOUTS
    assert len(few) < MIN_ROLLOUTS
    assert shrinkage_factor(few.sum(dim=0)) == pytest.approx((0.5, 0.0))
    flat = _one_token_rollouts([0.5] * 8, [0.0, 1.0] * 4)  # every value equals m
    assert shrinkage_factor(flat.sum(dim=0)) == pytest.approx((0.5, 0.0))
    m, alpha = shrinkage_factor(torch.zeros(7, dtype=torch.float64))
    assert math.isnan(m) and alpha == 0.0


def test_shrink_literal():
    values = torch.tensor([[0.0, 1.0, 0.4]])
    assert shrink(values, 0.4, 0.25)[0].tolist() == pytest.approx([0.3, 0.55, 0.4])


def test_the_window_keeps_the_newest_rollouts_and_uses_the_steps_mean_when_empty():
    window = ShrinkageWindow(capacity=8)
    empty = window.estimate(torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert (empty.mean, empty.alpha, empty.rollouts) == (0.5, 0.0, 0)
    window.add(_one_token_rollouts([5.0, 5.0], [1.0, 1.0]))  # pushed out below
    window.add(_one_token_rollouts([0.0, 1.0] * 4, [0.25, 0.75] * 4))
    full = window.estimate(torch.tensor([[9.0]]))  # the step's reward is not in m
    assert (full.mean, full.alpha, full.rollouts) == pytest.approx((0.5, 0.5, 8))


def test_the_window_sums_over_ranks():
    # two ranks holding the same four rollouts each: the sum of both is the eight-rollout case
    window = ShrinkageWindow(capacity=8, sum_over_ranks=lambda t: 2 * t)
    window.add(_one_token_rollouts([0.0, 1.0] * 2, [0.25, 0.75] * 2))
    estimate = window.estimate(torch.tensor([[0.0]]))
    assert (estimate.mean, estimate.alpha, estimate.rollouts) == pytest.approx((0.5, 0.5, 8))


def test_the_window_round_trips_and_clears():
    window = ShrinkageWindow(capacity=8)
    window.add(_one_token_rollouts([0.0, 1.0] * 4, [0.25, 0.75] * 4))
    restored = ShrinkageWindow(capacity=8)
    restored.load_state_dict(window.state_dict())
    assert restored.estimate(torch.zeros(1, 1)) == window.estimate(torch.zeros(1, 1))
    restored.clear()
    assert len(restored) == 0


def test_sao_without_a_window_uses_the_critic_as_it_is(tiny_qwen):
    algo = make_sao(tiny_qwen)
    assert algo.shrinkage is None
    metrics = algo.step(make_batch(tiny_qwen, rewards=(1.0, 0.5)))
    assert "shrinkage_alpha" not in metrics and "value_loss_adjusted" not in metrics


def test_sao_with_alpha_zero_baselines_on_the_mean_of_earlier_rewards(tiny_qwen):
    algo = make_sao(tiny_qwen, value_shrinkage_window=16)
    first = algo.step(make_batch(tiny_qwen, rewards=(1.0, 0.5)))
    assert (first["shrinkage_mean"], first["shrinkage_alpha"]) == (0.75, 0.0)  # the step's own mean
    batch = make_batch(tiny_qwen, rewards=(0.0, 0.2))
    second = algo.step(batch)
    assert (second["shrinkage_mean"], second["shrinkage_alpha"], second["shrinkage_rollouts"]) == (0.75, 0.0, 2.0)
    # every value is the constant 0.75: GAE of a constant baseline, computed here from scratch
    lam = length_adaptive_lambda(batch.action_mask.sum(dim=1), algo.cfg.lambda_alpha)
    expected, _ = skip_observation_gae(batch.rewards, torch.full_like(batch.rewards, 0.75), batch.action_mask,
                                       algo.cfg.gamma, lam)
    assert second["adv_mean"] == pytest.approx(float(expected[batch.action_mask].mean()), abs=1e-6)


def test_sao_forgets_and_checkpoints_the_window(tiny_qwen):
    algo = make_sao(tiny_qwen, value_shrinkage_window=16)
    algo.step(make_batch(tiny_qwen, rewards=(1.0, 0.5)))
    state = algo.state_dict()
    assert len(state["shrinkage_window"]) == 2
    resumed = make_sao(tiny_qwen, value_shrinkage_window=16)
    resumed.load_state_dict(state)
    assert resumed.shrinkage.state_dict() == state["shrinkage_window"]
    algo.forget()
    assert len(algo.shrinkage) == 0


def test_anchor_level_literal():
    values = torch.tensor([[0.3, 0.5, 0.9, 0.0], [0.1, 0.2, -0.4, 0.6]])
    mask = torch.tensor([[False, True, True, False], [False, False, True, True]])
    # row 0: first action at 1 (0.5): 0.2 + (V - 0.5); row 1: first action at 2 (-0.4): 0.2 + (V + 0.4)
    torch.testing.assert_close(anchor_level(values, mask, 0.2),
                               torch.tensor([[0.0, 0.2, 0.6, -0.3], [0.7, 0.8, 0.2, 1.2]]))


def test_shrinkage_and_levelling_are_not_set_together():
    with pytest.raises(ValueError, match="set one of them"):
        AlgorithmConfig(value_shrinkage_window=16, value_level_window=16)


def test_sao_levelled_takes_the_level_of_earlier_rewards_and_the_critics_course(tiny_qwen):
    algo = make_sao(tiny_qwen, value_level_window=16)
    first = algo.step(make_batch(tiny_qwen, rewards=(1.0, 0.5)))
    assert (first["level_mean"], first["level_rollouts"]) == (0.75, 0.0)  # the step's own mean
    assert "shrinkage_alpha" not in first
    batch = make_batch(tiny_qwen, rewards=(0.0, 0.2))
    with torch.no_grad():
        values = algo.critic(batch.input_ids, batch.attention_mask)  # the critic before the step (judge_then_fit)
    second = algo.step(batch)
    assert (second["level_mean"], second["level_rollouts"]) == (0.75, 2.0)
    # levelled by hand: each rollout's values minus its first action token's, plus 0.75
    first_action = [int(row.nonzero()[0]) for row in batch.action_mask]
    levelled = torch.stack([0.75 + values[i] - values[i, t] for i, t in enumerate(first_action)])
    lam = length_adaptive_lambda(batch.action_mask.sum(dim=1), algo.cfg.lambda_alpha)
    expected, _ = skip_observation_gae(batch.rewards, levelled, batch.action_mask, algo.cfg.gamma, lam)
    assert second["adv_mean"] == pytest.approx(float(expected[batch.action_mask].mean()), abs=1e-6)
    # the levelled values' squared error against the returns (gamma = lambda_critic = 1: the
    # rollout's reward, which batch.rewards holds at its last action token)
    errors = [(levelled[i, batch.action_mask[i]] - batch.rewards[i].sum()).pow(2) for i in range(2)]
    mse = float(torch.cat(errors).sum()) / int(batch.action_mask.sum())
    assert second["value_loss_adjusted"] == pytest.approx(mse, abs=1e-6)
    assert second["value_loss_adjusted"] != pytest.approx(second["value_loss"], abs=1e-6)
    algo.forget()
    assert len(algo.shrinkage) == 0
