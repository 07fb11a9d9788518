"""The engine's batched sampler: exact draws from the sampling distribution, per-request streams."""

from __future__ import annotations

import math

import torch

import pytest

from serving.engine.sampling import (GREEDY_TEMPERATURE, NonFiniteLogits, RowSampling, inverse_cdf_draw,
                                     sample_token, sample_tokens)

DRAWS = 40_000
Z_BOUND = 5.0
"""Frequencies may stray this many binomial standard deviations from their probability (a
seeded, deterministic test: the bound only has to hold for a correct sampler)."""


def draw_counts(logits: torch.Tensor, top_p: float, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    rows = [RowSampling(1.0, top_p, generator)] * 100
    counts = [0] * logits.shape[-1]
    for _ in range(DRAWS // 100):
        for token, _, _ in sample_tokens(logits.expand(100, -1), rows):
            counts[token] += 1
    return counts


def assert_frequencies(counts: list[int], probs: list[float]) -> None:
    for count, p in zip(counts, probs):
        if p == 0.0:
            assert count == 0
        else:
            sd = math.sqrt(DRAWS * p * (1 - p))
            assert abs(count - DRAWS * p) < Z_BOUND * sd, (counts, probs)


def test_draws_follow_the_distribution_and_never_leave_it():
    probs = [0.5, 0.25, 0.15, 0.1, 0.0]
    logits = torch.tensor(probs).log()  # the last token is -inf
    assert_frequencies(draw_counts(logits, 1.0, seed=0), probs)


def test_draws_follow_the_renormalised_nucleus():
    # top_p 0.8 keeps 0.5, 0.25 (0.75 before it is short of 0.8) and 0.15; 0.1 is left out
    logits = torch.tensor([0.1, 0.5, 0.15, 0.25]).log()
    assert_frequencies(draw_counts(logits, 0.8, seed=1), [0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9])


def test_a_rows_tokens_do_not_depend_on_its_batch():
    torch.manual_seed(0)
    logits = 2.0 * torch.randn(3, 30)
    streams = [torch.Generator().manual_seed(s) for s in (3, 7, 9)]
    batched, alone = [], []
    solo = torch.Generator().manual_seed(7)
    for _ in range(20):
        rows = [RowSampling(1.3, 1.0, streams[0]), RowSampling(0.9, 0.95, streams[1]),
                RowSampling(1e-4, 1.0, streams[2])]
        drawn = sample_tokens(logits, rows)
        assert drawn[2][0] == int(logits[2].argmax())  # the greedy row beside two drawn ones
        batched.append(drawn[1])
        alone.append(sample_token(logits[1], 0.9, 0.95, solo))
    assert batched == alone
    assert len({t for t, _, _ in alone}) > 1  # it really draws


def test_the_same_seed_draws_the_same_tokens():
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample_token(logits, 1.0, 1.0, g)[0] for _ in range(50)]

    assert run(5) == run(5) and run(5) != run(6)


def test_uniforms_at_the_ends_pick_the_first_and_last_possible_tokens():
    logp = torch.tensor([[-math.inf, math.log(0.5), -math.inf, math.log(0.5), -math.inf]] * 3)
    uniforms = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)  # 1.0: a product that rounded up to the total
    assert inverse_cdf_draw(logp, uniforms).tolist() == [1, 3, 3]


def test_a_greedy_row_logs_the_point_mass_that_chose_its_token():
    """Two logits 5e-5 apart: at the greedy temperature the tempered distribution gives the arg-max
    0.62 (exp(0.5) / (1 + exp(0.5))), but the engine takes it every time: its log-probability is 0."""
    logits = torch.full((8,), -10.0)
    logits[3], logits[5] = 2.0, 2.0 - 5e-5
    picks = {sample_token(logits, GREEDY_TEMPERATURE, 1.0, torch.Generator().manual_seed(s))[:2] for s in range(20)}
    assert picks == {(3, 0.0)}
    token, logprob, _ = sample_token(logits, 2e-4, 1.0, torch.Generator().manual_seed(0))  # drawn: its own
    expected = {3: -math.log1p(math.exp(-0.25)), 5: -math.log1p(math.exp(0.25))}[token]
    assert logprob == pytest.approx(expected, abs=2e-3)  # float32 logits / 2e-4 are ~1e4, spaced ~1e-3


def test_non_finite_logits_fail_with_the_cause_instead_of_drawing_token_zero():
    logits = torch.zeros(2, 8)
    logits[1, 4] = float("nan")
    rows = [RowSampling(1.0, 1.0, torch.Generator().manual_seed(i)) for i in range(2)]
    with pytest.raises(NonFiniteLogits, match="not finite for 1 of 2 rows"):
        sample_tokens(logits, rows)
