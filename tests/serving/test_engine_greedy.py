"""Greedy decoding in the engine's sampler decided and chosen exactly as the learner scores it.

The learner (online_sao/sampling.py, ``sampled_logprobs``) evaluates a greedy token as the point mass
at the arg-max of the raw logits, deciding greediness on the float32 temperature its batch holds
(online_sao/batch.py). A token the engine takes otherwise is scored -inf, or a drawn one 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from online_sao.schemas import SamplingParams
from serving.engine.sampling import GREEDY_TEMPERATURE, RowSampling, sample_token, sample_tokens

SEEDS = range(20)
"""Draws per case: at the near tie below a drawing sampler takes the runner-up with probability 0.38
each time, so all 20 missing it would take about 7e-5 luck (and the seeds fix the draws)."""
ABOVE_GREEDY = 1.00000001e-4
"""A temperature the API accepts that is above GREEDY_TEMPERATURE as a Python float and equal to it in
float32 (the nearest float32 values around 1e-4 are about 7e-12 apart)."""
TIE_LOW = 1.6384003162384033
"""A float32 logit that, divided by the float32 greedy temperature, rounds to the same value as the next
float32 above it (both near 16384, where float32 values are 2**-9 apart, while the logits' difference
divided by 1e-4 is about 1.2e-3)."""


def near_tie() -> torch.Tensor:
    """Logits 5e-5 apart at tokens 3 and 5: tempered at 1e-4 the leader has probability 1/(1 + e^-0.5) = 0.62."""
    logits = torch.full((8,), -10.0)
    logits[3], logits[5] = 2.0, 2.0 - 5e-5
    return logits


def test_a_temperature_that_is_greedy_in_float32_is_decoded_greedily():
    assert ABOVE_GREEDY > GREEDY_TEMPERATURE  # the edge: greedy only once rounded to float32
    assert torch.tensor(ABOVE_GREEDY, dtype=torch.float32) == torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32)
    SamplingParams(temperature=ABOVE_GREEDY)  # the API takes it
    picks = {sample_token(near_tie(), ABOVE_GREEDY, 1.0, torch.Generator().manual_seed(s))[:2] for s in SEEDS}
    assert picks == {(3, 0.0)}  # the arg-max and the point mass's log-probability, every time


def test_the_next_float32_temperature_is_still_drawn():
    """The float32 rule does not widen the greedy range: one float32 step above 1e-4 is drawn from the
    tempered distribution, whose log-probabilities at tokens 3 and 5 are -log(1 + e^-t) and -log(1 + e^t)
    with t = 5e-5 / T = 0.5: to within 2e-3, the float32 spacing of the tempered logits (near 2e4)."""
    above = float(torch.nextafter(torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32), torch.tensor(1.0)))
    picks = {sample_token(near_tie(), above, 1.0, torch.Generator().manual_seed(s))[:2] for s in SEEDS}
    assert {token for token, _ in picks} == {3, 5}
    for token, logprob in picks:
        assert logprob == pytest.approx(-math.log1p(math.exp(-0.5 if token == 3 else 0.5)), abs=2e-3)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
@pytest.mark.parametrize("beside", [None, 1.0], ids=["alone", "beside-a-drawn-row"])
def test_a_greedy_token_is_the_arg_max_of_the_raw_logits(top_p, beside):
    """Two adjacent float32 logits that dividing by the greedy temperature rounds to one value: the larger
    raw logit (token 1) is the token, where the tempered arg-max took the lower id (token 0). At top_p 0.5
    token 1 is even outside the tempered nucleus (after token 0's half of the mass, ties going to the lower
    id), and still the learner's arg-max."""
    low = torch.tensor(TIE_LOW, dtype=torch.float32)
    high = torch.nextafter(low, torch.tensor(math.inf))
    temperature = torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32)
    assert high > low and high / temperature == low / temperature  # the tie the temperature makes
    logits = torch.full((4,), -10.0)
    logits[0], logits[1] = low, high
    rows = [RowSampling(GREEDY_TEMPERATURE, top_p, torch.Generator().manual_seed(0), top_logprobs=2)]
    if beside is not None:
        rows.append(RowSampling(beside, 1.0, torch.Generator().manual_seed(1)))
    token, logprob, _ = sample_tokens(logits.expand(len(rows), -1), rows)[0]
    assert (token, logprob) == (1, 0.0)


def test_a_greedy_row_lists_the_tempered_alternatives_beside_its_point_mass():
    """The documented contract (serving/engine/base.py, TokenEvent.top_logprobs): the logged log-probability
    is the point mass's 0, the alternatives those of the tempered distribution, the chosen token's own
    entry included: log(0.62) = -log(1 + e^-0.5), the runner-up's -log(1 + e^0.5)."""
    token, logprob, alternatives = sample_token(near_tie(), GREEDY_TEMPERATURE, 1.0,
                                                torch.Generator().manual_seed(0), top_logprobs=2)
    assert (token, logprob) == (3, 0.0)
    assert [t for t, _ in alternatives] == [3, 5]
    expected = [-math.log1p(math.exp(-0.5)), -math.log1p(math.exp(0.5))]
    assert [lp for _, lp in alternatives] == pytest.approx(expected, abs=2e-3)  # logits / 1e-4: float32 ~2e-3 apart
