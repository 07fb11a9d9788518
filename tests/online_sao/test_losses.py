import math

import pytest
import torch

from online_sao.losses import (
    clipped_surrogate_loss,
    dis_policy_loss,
    endpoint_squared_errors,
    explained_variance,
    token_logprobs,
    value_loss,
)

LN2 = math.log(2.0)


def _band_case():
    # one row, token 0 is the prompt; ratios on the three action tokens are
    # exp(0) = 1, exp(ln 2) = 2 and exp(ln 0.5) = 0.5 (all exact in float32)
    logprobs = torch.tensor([[0.0, -1.0, -1.0 + LN2, -1.0 - LN2]], requires_grad=True)
    rollout = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    advantages = torch.tensor([[0.0, 3.0, 5.0, -7.0]])
    mask = torch.tensor([[False, True, True, True]])
    return logprobs, rollout, advantages, mask


def test_ratio_exactly_on_either_band_edge_is_masked():
    logprobs, rollout, advantages, mask = _band_case()
    # band with eps_low = 0.5, eps_high = 1.0 is the open interval (0.5, 2): r = 2 and r = 0.5 sit on its edges
    loss, metrics = dis_policy_loss(logprobs, rollout, advantages, mask, eps_low=0.5, eps_high=1.0)
    # only token 1 is kept: L = -(1 * 3) / N, N = 3 action tokens (masked tokens stay in N)
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["kept_frac"] == pytest.approx(1 / 3)
    assert metrics["masked_above_frac"] == pytest.approx(1 / 3)
    assert metrics["masked_below_frac"] == pytest.approx(1 / 3)
    # mean r = (1 + 2 + 0.5) / 3 = 7/6
    assert metrics["ratio_mean"] == pytest.approx(7 / 6)
    # approx KL = mean((r - 1) - ln r) = (0 + (1 - ln2) + (-0.5 + ln2)) / 3 = 0.5 / 3
    assert metrics["approx_kl"] == pytest.approx(1 / 6)
    loss.backward()
    # dL/dlogp_1 = -r A / N = -(1 * 3) / 3 = -1; masked tokens (A = +5 above, A = -7 below) get exactly 0
    assert logprobs.grad.tolist() == [[0.0, -1.0, 0.0, 0.0]]


def test_negative_advantage_above_band_gives_zero_gradient_unlike_ppo_clip():
    # r = exp(ln 3) = 3 >= 1 + eps_high = 2 with A = -1: DIS masks it, PPO's min() would keep r * A
    logprobs = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    zeros = torch.zeros(1, 2)
    advantages = torch.tensor([[0.0, -1.0]])
    mask = torch.tensor([[False, True]])
    loss, _ = dis_policy_loss(logprobs, zeros, advantages, mask, eps_low=0.3, eps_high=1.0)
    loss.backward()
    assert loss.item() == 0.0
    assert logprobs.grad.tolist() == [[0.0, 0.0]]

    ppo_logprobs = logprobs.detach().clone().requires_grad_(True)
    ppo_loss, _ = clipped_surrogate_loss(ppo_logprobs, zeros, advantages, mask, clip_low=0.2, clip_high=0.28)
    ppo_loss.backward()
    # min(3 * -1, 1.28 * -1) = -3 is the unclipped branch: gradient -r A / N = 3
    assert ppo_logprobs.grad[0, 1].item() == pytest.approx(3.0)


def test_normalizer_replaces_the_action_token_count():
    logprobs, rollout, advantages, mask = _band_case()
    loss, _ = dis_policy_loss(logprobs, rollout, advantages, mask, eps_low=0.5, eps_high=1.0, normalizer=6.0)
    assert loss.item() == pytest.approx(-3.0 / 6.0)


def test_nan_behaviour_logprob_is_masked_and_counted():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[0.0, float("nan"), 0.0]])
    mask = torch.tensor([[False, True, True]])
    loss, metrics = dis_policy_loss(logprobs, rollout, torch.ones(1, 3), mask, 0.3, 5.0)
    assert loss.item() == pytest.approx(-0.5)  # only token 2: -(1 * 1) / 2
    assert metrics["masked_nan_frac"] == pytest.approx(0.5)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_batch_without_action_tokens_gives_zero_loss():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = dis_policy_loss(logprobs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool),
                                    0.3, 5.0)
    assert loss.item() == 0.0 and metrics["kept_frac"] == 0.0


def test_dis_gradient_matches_closed_form_on_kept_tokens():
    torch.manual_seed(0)
    b, t, v = 3, 7, 11
    logits = torch.randn(b, t, v, requires_grad=True)
    input_ids = torch.randint(0, v, (b, t))
    temperature = torch.tensor([1.0, 0.7, 1.3])
    mask = torch.rand(b, t) < 0.7
    mask[:, 0] = False
    advantages = torch.randn(b, t)
    logp = token_logprobs(logits, input_ids, temperature.view(b, 1).expand(b, t), torch.ones(b, t))
    # behaviour log-probs shifted by noise wide enough that some tokens leave the band (0.7, 1.5)
    rollout = (logp.detach() + 0.6 * torch.randn(b, t)) * mask
    loss, metrics = dis_policy_loss(logp, rollout, advantages, mask, eps_low=0.3, eps_high=0.5)
    assert 0.0 < metrics["kept_frac"] < 1.0
    loss.backward()

    with torch.no_grad():
        ratio = (logp - rollout).exp()
        kept = mask & (ratio > 0.7) & (ratio < 1.5)
        n = mask.sum()
        expected = torch.zeros(b, t, v)
        for i in range(b):
            for pos in range(1, t):
                if kept[i, pos]:
                    # grad of log softmax(z / tau)[x] wrt z is (onehot(x) - softmax(z / tau)) / tau
                    probs = torch.softmax(logits[i, pos - 1] / temperature[i], dim=-1)
                    grad_logp = (torch.nn.functional.one_hot(input_ids[i, pos], v) - probs) / temperature[i]
                    expected[i, pos - 1] -= ratio[i, pos] * advantages[i, pos] * grad_logp / n
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-6)


def test_token_logprobs_alignment_and_temperature():
    # vocabulary of 2; the logits at position 0 ([0, ln 3]) predict token 1
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]] * 2)
    input_ids = torch.tensor([[0, 1]] * 2)
    out = token_logprobs(logits, input_ids, torch.tensor([[1.0, 1.0], [1.0, 2.0]]), torch.ones(2, 2))
    assert out[:, 0].tolist() == [0.0, 0.0]
    # temperature 1: p(1) = 3 / (1 + 3) = 0.75
    assert out[0, 1].item() == pytest.approx(math.log(0.75))
    # temperature 2: logits / 2 = [0, ln 3 / 2]: p(1) = sqrt3 / (1 + sqrt3)
    assert out[1, 1].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_clipped_surrogate_literals():
    # pi_old log-probs 0; ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1; clip range [0.8, 1.28]
    logprobs = torch.tensor([[0.0, math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)]], requires_grad=True)
    old = torch.zeros(1, 5)
    advantages = torch.tensor([[0.0, 1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[False, True, True, True, True]])
    loss, metrics = clipped_surrogate_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    # min(1.5, 1.28) = 1.28 (clipped); min(-1.5, -1.28) = -1.5; min(0.5, 0.8) = 0.5; min(-0.5, -0.8) = -0.8 (clipped)
    # L = -(1.28 - 1.5 + 0.5 - 0.8) / 4 = 0.52 / 4 = 0.13
    assert loss.item() == pytest.approx(0.13)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # unclipped tokens: -r A / N = -(1.5 * -1) / 4 = 0.375 and -(0.5 * 1) / 4 = -0.125; clipped ones 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.375, -0.125, 0.0]]))


def test_clipped_surrogate_with_dis_drops_tokens_outside_the_band():
    logprobs = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    # behaviour ratio exp(0 - (-ln 3)) = 3 for token 2: outside (0.7, 2)
    rollout = torch.tensor([[0.0, 0.0, -math.log(3.0)]])
    mask = torch.tensor([[False, True, True]])
    loss, metrics = clipped_surrogate_loss(logprobs, old, torch.ones(1, 3), mask, 0.2, 0.28,
                                           rollout_logprobs=rollout, eps_low=0.3, eps_high=1.0)
    assert loss.item() == pytest.approx(-0.5)  # -(1 * 1) / 2
    assert metrics["kept_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        clipped_surrogate_loss(logprobs, old, torch.ones(1, 3), mask, 0.2, 0.28, rollout_logprobs=rollout)


def test_clip_frac_counts_only_the_tokens_the_loss_takes():
    """A token DIS drops, or outside the current nucleus, has no clipped branch to take: clip_frac is
    the share of the kept tokens where the clip binds (it was over every action token, DIS-dropped
    ones counted)."""
    ln = math.log
    # pi_old log-probs 0, advantages +1, clip range [0.8, 1.28], DIS band (0.7, 2):
    # t1 rho 1.5, behaviour ratio 1 (kept, clipped); t2 rho 1.5, behaviour ratio 3 (dropped by DIS);
    # t3 rho 1 (kept); t4 outside the current nucleus (-inf, dropped); t5 rho 0.5 (kept, not clipped)
    logprobs = torch.tensor([[0.0, ln(1.5), ln(1.5), 0.0, -math.inf, ln(0.5)]], requires_grad=True)
    rollout = torch.tensor([[0.0, ln(1.5), ln(1.5) - ln(3.0), 0.0, 0.0, ln(0.5)]])
    mask = torch.tensor([[False, True, True, True, True, True]])
    loss, metrics = clipped_surrogate_loss(logprobs, torch.zeros(1, 6), torch.ones(1, 6), mask, 0.2, 0.28,
                                           rollout_logprobs=rollout, eps_low=0.3, eps_high=1.0)
    # L = -(1.28 + 1 + 0.5) / 5 = -0.556
    assert loss.item() == pytest.approx(-0.556)
    assert metrics["kept_frac"] == pytest.approx(3 / 5)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)  # t1 of t1, t3, t5 (was 2 / 5)
    # every token outside the band: none enters the loss, none is clipped
    _, metrics = clipped_surrogate_loss(logprobs, torch.zeros(1, 6), torch.ones(1, 6), mask, 0.2, 0.28,
                                        rollout_logprobs=rollout + 5.0, eps_low=0.3, eps_high=1.0)
    assert metrics["kept_frac"] == 0.0 and metrics["clip_frac"] == 0.0


def test_value_loss_literal_and_explained_variance():
    values = torch.tensor([[9.0, 1.0, 2.0, 3.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 0.0, 2.0, 5.0]])
    mask = torch.tensor([[False, True, True, True]])
    loss, metrics = value_loss(values, returns, mask)
    # ((1 - 0)^2 + (2 - 2)^2 + (3 - 5)^2) / 3 = 5 / 3; the prompt's value 9 is ignored
    assert loss.item() == pytest.approx(5 / 3)
    loss.backward()
    # d/dV = 2 (V - G) / N = [2/3, 0, -4/3]
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 2 / 3, 0.0, -4 / 3]]))
    # Var(G) over [0, 2, 5] = 38/9; G - V = [-1, 0, 2], Var = 14/9; EV = 1 - 14/38 = 12/19
    assert metrics["explained_variance"] == pytest.approx(12 / 19)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(values.detach(), torch.ones(1, 4), mask))
    # returns that differ by 1e-4 (variance 2.5e-9 < MIN_EXPLAINABLE_VARIANCE): nothing to explain
    nearly_equal = torch.tensor([[0.0, 1e-4, 0.0, 1e-4]])
    assert math.isnan(explained_variance(torch.full((1, 4), 0.2), nearly_equal, torch.ones(1, 4, dtype=torch.bool)))


def _outside_nucleus_case():
    # vocabulary [0.6, 0.3, 0.1]; top_p 0.5 keeps token 0 only. Row tokens: prompt, then 0 (kept) and 2
    # (outside the current nucleus: log-prob -inf although the engine sampled it from an older policy)
    logits = torch.tensor([[0.6, 0.3, 0.1]] * 3).log().unsqueeze(0).requires_grad_()
    input_ids = torch.tensor([[1, 0, 2]])
    logprobs = token_logprobs(logits, input_ids, torch.ones(1, 3), torch.full((1, 3), 0.5))
    assert logprobs[0, 1].item() == 0.0 and logprobs[0, 2].item() == -math.inf
    return logits, logprobs, torch.tensor([[False, True, True]])


def test_endpoint_squared_errors_take_each_rows_first_and_last_action_token():
    # row 0: actions at 1, 2, 3 (prompt at 0); row 1: one action at 2 (first = last); row 2: none
    values = torch.tensor([[9.0, 0.5, 0.7, 0.9], [9.0, 9.0, 0.2, 9.0], [9.0, 9.0, 9.0, 9.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.6, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[False, True, True, True], [False, False, True, False], [False, False, False, False]])
    metrics = endpoint_squared_errors(values, returns, mask)
    # first: ((0.5 - 1)^2 + (0.2 - 0.6)^2) / 2 = (0.25 + 0.16) / 2; last: ((0.9 - 1)^2 + 0.16) / 2
    assert metrics["value_loss_first"] == pytest.approx(0.205)
    assert metrics["value_loss_last"] == pytest.approx(0.085)


def test_endpoint_squared_errors_without_action_tokens_are_nan():
    metrics = endpoint_squared_errors(torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert math.isnan(metrics["value_loss_first"]) and math.isnan(metrics["value_loss_last"])


def test_token_outside_the_current_nucleus_is_masked_out_of_dis_and_counted():
    logits, logprobs, mask = _outside_nucleus_case()
    rollout = torch.tensor([[0.0, -0.1, -2.0]])
    loss, metrics = dis_policy_loss(logprobs, rollout, torch.tensor([[0.0, 1.0, 1.0]]), mask, 0.2, 0.3)
    loss.backward()
    assert metrics["outside_nucleus_frac"] == 0.5 and metrics["kept_frac"] == 0.5
    assert metrics["masked_below_frac"] == 0.5  # ratio 0
    assert math.isfinite(metrics["approx_kl"]) and math.isfinite(loss.item())
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1].abs().sum() == 0  # the token outside the nucleus trains nothing


def test_token_outside_the_nucleus_of_pi_and_pi_old_is_masked_out_of_the_clipped_surrogate():
    logits, logprobs, mask = _outside_nucleus_case()
    loss, metrics = clipped_surrogate_loss(logprobs, logprobs.detach(), torch.tensor([[0.0, 1.0, 1.0]]), mask,
                                           0.2, 0.2)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logits.grad).all()  # -inf - -inf is not a number
    assert metrics["outside_nucleus_frac"] == 0.5 and metrics["ratio_mean"] == 1.0
    assert logits.grad[0, 1].abs().sum() == 0
