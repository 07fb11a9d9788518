"""The pure monitors: the KL estimator on hand-computed log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from online_sao.monitors import reference_kl

INF = float("inf")


def test_reference_kl_is_the_k3_mean_over_counted_action_tokens():
    logprobs = torch.tensor([[0.0, math.log(0.5), math.log(0.25)], [0.0, math.log(0.2), math.log(0.3)]])
    ref = torch.tensor([[0.0, math.log(0.25), math.log(0.25)], [0.0, math.log(0.6), -INF]])
    mask = torch.tensor([[False, True, True], [False, True, True]])
    value, metrics = reference_kl(logprobs, ref, mask)
    # d = log ref - log pi: -ln 2, 0, ln 3 (the -inf token is outside the reference's nucleus: left out)
    # k3 = e^d - 1 - d: 0.5 - 1 + ln 2 = 0.19314718055994530, 0, 3 - 1 - ln 3 = 0.90138771133189020
    assert value == pytest.approx((0.1931471805599453 + 0.0 + 0.9013877113318902) / 3, abs=1e-7)
    assert metrics["kl_k1"] == pytest.approx((0.6931471805599453 + 0.0 - 1.0986122886681098) / 3, abs=1e-7)
    assert metrics["kl_tokens"] == 3.0


def test_reference_kl_is_zero_for_the_same_policy_and_nan_without_tokens():
    logprobs = torch.tensor([[0.0, -1.2, -0.3]])
    value, metrics = reference_kl(logprobs, logprobs.clone(), torch.tensor([[False, True, True]]))
    assert value == 0.0 and metrics["kl_k1"] == 0.0
    empty, metrics = reference_kl(logprobs, logprobs, torch.zeros(1, 3, dtype=torch.bool))
    assert math.isnan(empty) and metrics["kl_tokens"] == 0.0
