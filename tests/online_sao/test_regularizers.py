"""KL penalty, entropy bonus and EMA reference against numbers worked out by hand."""

import math

import pytest
import torch
from torch import nn

from online_sao.losses import action_entropy
from online_sao.regularizers import ema_update_, entropy_bonus, kl_penalty
from online_sao.sampling import GREEDY_TEMPERATURE

# d = ref - logp on the two action tokens: 0.5 and -0.25
# k3(0.5)   = e^0.5 - 1 - 0.5    = 1.6487212707 - 1.5  = 0.1487212707
# k3(-0.25) = e^-0.25 - 1 + 0.25 = 0.7788007831 - 0.75 = 0.0288007831
K3_A, K3_B = 0.1487212707, 0.0288007831
MASK = torch.tensor([[False, True, True, False]])


def _kl_inputs():
    # the last token is not an action, and its d = -0.5 - (-300) = 299.5 would overflow exp
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -300.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -0.5, -2.25, -0.5]])
    return logprobs, ref


def test_kl_penalty_is_beta_times_the_mean_k3_over_action_tokens():
    logprobs, ref = _kl_inputs()
    loss, metrics = kl_penalty(logprobs, ref, MASK, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * (K3_A + K3_B) / 2, rel=1e-6)
    assert metrics["kl_ref"] == pytest.approx((K3_A + K3_B) / 2, rel=1e-6)
    assert metrics["kl_loss"] == pytest.approx(0.1 * (K3_A + K3_B) / 2, rel=1e-6)
    loss.backward()
    # dk3/dlogp = 1 - e^d, times beta / N = 0.05; nothing off the action tokens
    expected = [0.0, 0.05 * (1 - math.exp(0.5)), 0.05 * (1 - math.exp(-0.25)), 0.0]
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected]), rtol=1e-6, atol=1e-9)


def test_kl_penalty_divides_by_the_given_normalizer_like_the_dis_loss():
    logprobs, ref = _kl_inputs()
    loss, metrics = kl_penalty(logprobs, ref, MASK, beta=0.1, normalizer=4.0)
    assert loss.item() == pytest.approx(0.1 * (K3_A + K3_B) / 4, rel=1e-6)
    assert metrics["kl_ref"] == pytest.approx((K3_A + K3_B) / 2, rel=1e-6)  # the estimate does not change


def test_kl_penalty_is_zero_at_the_reference():
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    loss, metrics = kl_penalty(logprobs, logprobs.clone(), torch.tensor([[False, True, True]]), beta=1.0)
    assert loss.item() == 0.0 and metrics["kl_ref"] == 0.0


def _entropy_logits() -> torch.Tensor:
    """[1, 3, 4]: position 1 is drawn from logits[0, 0] (uniform: H = ln 4 = 1.3862943611),
    position 2 from logits[0, 1] = [2 ln 3, 0, -1e4, -1e4], which at temperature 2 is
    p = [3/4, 1/4, 0, 0]: H = 1/4 ln 4 + 3/4 ln 4/3 = 0.5623351446."""
    logits = torch.zeros(1, 3, 4)
    logits[0, 1] = torch.tensor([2 * math.log(3), 0.0, -1e4, -1e4])
    logits[0, 2] = torch.tensor([5.0, -5.0, 0.0, 1.0])  # predicts past the end: never used
    return logits


AT_TWO = (torch.full((1, 3), 2.0), torch.ones(1, 3))
"""Every token sampled at temperature 2 without a nucleus (top_p 1)."""


def test_action_entropy_at_the_sampling_temperature():
    entropy = action_entropy(_entropy_logits(), torch.tensor([[False, True, True]]), *AT_TWO)
    torch.testing.assert_close(entropy, torch.tensor([[0.0, 1.3862943611, 0.5623351446]]), rtol=1e-6, atol=1e-7)


def test_action_entropy_is_zero_off_action_tokens():
    entropy = action_entropy(_entropy_logits(), torch.tensor([[False, False, True]]), *AT_TWO)
    torch.testing.assert_close(entropy, torch.tensor([[0.0, 0.0, 0.5623351446]]), rtol=1e-6, atol=1e-7)


def test_entropy_bonus_is_minus_alpha_times_the_mean_entropy_and_raises_entropy():
    logits = _entropy_logits().requires_grad_(True)
    mask = torch.tensor([[False, True, True]])
    entropy = action_entropy(logits, mask, torch.full((1, 3), 2.0), torch.ones(1, 3))
    loss, metrics = entropy_bonus(entropy, mask, alpha=0.01)
    mean_h = (1.3862943611 + 0.5623351446) / 2
    assert loss.item() == pytest.approx(-0.01 * mean_h, rel=1e-6)
    assert metrics["entropy"] == pytest.approx(mean_h, rel=1e-6)
    assert metrics["entropy_loss"] == pytest.approx(-0.01 * mean_h, rel=1e-6)
    loss.backward()
    # the uniform distribution is the entropy's maximum: no gradient there
    torch.testing.assert_close(logits.grad[0, 0], torch.zeros(4), rtol=0, atol=1e-9)
    # a step against the gradient moves the peaked distribution toward uniform
    with torch.no_grad():
        stepped = logits - 10.0 * logits.grad
    assert float(action_entropy(stepped, mask, torch.full((1, 3), 2.0), torch.ones(1, 3))[0, 2]) > 0.5623351446


def test_ema_update_moves_the_reference_a_share_of_the_way():
    reference, policy = nn.Linear(2, 1), nn.Linear(2, 1)
    with torch.no_grad():
        reference.weight.copy_(torch.tensor([[0.0, 4.0]]))
        reference.bias.fill_(1.0)
        policy.weight.copy_(torch.tensor([[4.0, 0.0]]))
        policy.bias.fill_(-3.0)
    ema_update_(reference, policy, rate=0.25)
    torch.testing.assert_close(reference.weight, torch.tensor([[1.0, 3.0]]))
    torch.testing.assert_close(reference.bias, torch.tensor([0.0]))
    torch.testing.assert_close(policy.weight, torch.tensor([[4.0, 0.0]]))  # the policy is untouched


def test_ema_update_refuses_a_rate_outside_zero_one():
    with pytest.raises(ValueError, match="rate"):
        ema_update_(nn.Linear(2, 1), nn.Linear(2, 1), rate=0.0)


def test_action_entropy_takes_each_tokens_own_temperature_like_token_logprobs():
    # position t holds token t's settings (a packed row mixes rollouts); position 0's are never used
    temperature = torch.tensor([[7.0, 2.0, 2.0]])
    entropy = action_entropy(_entropy_logits(), torch.tensor([[False, True, True]]), temperature, torch.ones(1, 3))
    torch.testing.assert_close(entropy, torch.tensor([[0.0, 1.3862943611, 0.5623351446]]), rtol=1e-6, atol=1e-7)


def test_action_entropy_is_the_nucleus_distributions():
    # top_p 0.5: the uniform four keep their two lowest ids (H = ln 2); [3/4, 1/4, 0, 0] keeps one token (H = 0)
    mask = torch.tensor([[False, True, True]])
    logits = _entropy_logits().requires_grad_(True)
    entropy = action_entropy(logits, mask, torch.full((1, 3), 2.0), torch.full((1, 3), 0.5))
    torch.testing.assert_close(entropy, torch.tensor([[0.0, math.log(2.0), 0.0]]), rtol=1e-6, atol=1e-6)
    entropy.sum().backward()  # tokens outside the nucleus: no 0 * -inf in the gradient
    assert torch.isfinite(logits.grad).all()


def test_kl_penalty_leaves_out_tokens_outside_either_nucleus():
    logprobs = torch.tensor([[0.0, -1.0, float("-inf"), -0.5]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.2, float("-inf"), float("-inf")]])
    loss, metrics = kl_penalty(logprobs, ref, torch.tensor([[False, True, True, True]]), beta=1.0)
    loss.backward()
    k3 = math.exp(-0.2) - 1.0 + 0.2  # the one token inside both nuclei
    assert loss.item() == pytest.approx(k3 / 3, rel=1e-6) and metrics["kl_ref"] == pytest.approx(k3, rel=1e-6)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 2:].abs().sum() == 0


def test_a_greedy_tokens_entropy_is_the_point_masss_zero_with_no_gradient():
    # At GREEDY_TEMPERATURE the engines take the arg-max: a point mass, entropy 0. Two logits 1e-4
    # apart would give about ln 2 / 1.3 at that temperature, with a gradient of order 1 / temperature.
    logits = torch.tensor([[[1.0, 1.0001, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]], requires_grad=True)
    mask = torch.tensor([[False, True, True]])
    temperature = torch.tensor([[1.0, GREEDY_TEMPERATURE, 1.0]])
    entropy = action_entropy(logits, mask, temperature, torch.ones(1, 3))
    torch.testing.assert_close(entropy, torch.tensor([[0.0, 0.0, math.log(3.0)]]), rtol=1e-6, atol=1e-7)
    entropy.sum().backward()
    assert torch.equal(logits.grad[0, 0], torch.zeros(3))  # the greedy token's distribution
    torch.testing.assert_close(logits.grad[0, 1], torch.zeros(3), rtol=0, atol=1e-7)  # uniform: H's maximum
