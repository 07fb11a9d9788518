"""The one definition of the sampling distribution that the engine and the learner share."""

from __future__ import annotations

import math

import torch

from online_sao.sampling import nucleus_logprobs, nucleus_mask, sampled_logprobs
from tests.fixtures.engine_reference import reference_logprob


def test_ties_at_the_threshold_keep_the_lower_token_id():
    # four equally likely tokens: the nucleus of 0.5 is two of them, always the two lowest ids
    logp = torch.full((4,), math.log(0.25))
    assert nucleus_mask(logp, 0.5).tolist() == [True, True, False, False]
    assert nucleus_mask(logp.flip(0), torch.tensor(0.5)).tolist() == [True, True, False, False]


def test_batched_settings_match_one_distribution_at_a_time_and_a_float64_reference():
    torch.manual_seed(0)
    logits = 3.0 * torch.randn(6, 50)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.7, 1.0, 1.3])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.5, 1.0, 0.9])
    batched = nucleus_logprobs(logits, temperature, top_p)
    for row in range(6):
        alone = nucleus_logprobs(logits[row], float(temperature[row]), float(top_p[row]))
        assert torch.equal(batched[row], alone)
        for token in range(50):
            expected = reference_logprob(logits[row], token, float(temperature[row]), float(top_p[row]))
            got = float(alone[token])
            assert (got == expected == -math.inf) or abs(got - expected) < 1e-5


def test_sampled_logprobs_gathers_the_nucleus_logprobs_and_their_gradient():
    torch.manual_seed(1)
    logits = (2.0 * torch.randn(2, 5, 40)).requires_grad_()
    tokens = torch.randint(0, 40, (2, 5))
    temperature = torch.tensor([[0.7, 1.0, 1.3, 1.0, 0.9]] * 2)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 1.0, 0.95], [0.5, 1.0, 1.0, 0.9, 1.0]])
    got = sampled_logprobs(logits, tokens, temperature, top_p)
    full = nucleus_logprobs(logits, temperature, top_p).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, full, atol=1e-6) and torch.equal(torch.isinf(got), torch.isinf(full))
    finite = torch.isfinite(full)
    (grad_got,) = torch.autograd.grad(got[finite].sum(), logits)
    (grad_full,) = torch.autograd.grad(full[finite].sum(), logits)
    assert torch.allclose(grad_got, grad_full, atol=1e-6)
