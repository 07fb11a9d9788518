"""Drawing tokens from the engine's sampling distribution, a whole decode batch at a time.

The distribution itself, and the behaviour log-probability logged with each
token, is :func:`online_sao.sampling.nucleus_logprobs`: the learner recomputes
the same function under the current policy, so its importance ratio compares
against what really sampled the token.

A row is drawn by inverting its cumulative distribution at one uniform number
taken from the row's own generator (float64 throughout). This is an exact draw
from the row's distribution, costs one random number per token (not one per
vocabulary entry, as ``torch.multinomial``'s exponential race does), runs as one
tensor op for the batch, and keeps a seeded request reproducible and independent
of which other requests share its batch: its generator is consumed only by its
own rows.

``SamplingParams`` requires ``temperature > 0``. At or below
:data:`GREEDY_TEMPERATURE` the engine takes the arg-max instead of drawing (the
tempered distribution is a point mass up to float rounding, and drawing from it
would only turn rounding noise into different tokens). The distribution that
chose the token is then the point mass, and its log-probability, 0, is what is
logged (the learner evaluates the same point mass: online_sao/sampling.py).

Non-finite logits (weights or activations that overflowed) fail the step's
requests with :class:`NonFiniteLogits`, naming the cause, instead of drawing
token 0 with a NaN log-probability that no record accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from online_sao.sampling import GREEDY_TEMPERATURE, nucleus_logprobs

__all__ = ["GREEDY_TEMPERATURE", "NonFiniteLogits", "RowSampling", "inverse_cdf_draw", "most_likely", "nucleus_logprobs", "sample_token",
           "sample_tokens"]


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits for a row: nothing can be sampled from them."""

Sampled = tuple[int, float, tuple[tuple[int, float], ...]]
"""``(token_id, behaviour logprob, alternatives)`` of one row."""


@dataclass(frozen=True)
class RowSampling:
    """How one row of a batch is sampled."""

    temperature: float
    top_p: float
    generator: torch.Generator
    """The request's own random stream (seeded or not)."""
    top_logprobs: int = 0
    """How many of the most likely tokens to return beside the sampled one."""


def most_likely(logp: torch.Tensor, count: int) -> tuple[tuple[int, float], ...]:
    """The ``count`` most likely tokens of ``logp [V]`` as ``(token_id, logprob)``, most likely first;
    tokens outside the nucleus (``-inf``) are left out, so there may be fewer."""
    if count <= 0:
        return ()
    values, ids = torch.topk(logp, min(count, logp.shape[-1]))
    return tuple((int(i), min(float(v), 0.0)) for v, i in zip(values, ids) if torch.isfinite(v))


def inverse_cdf_draw(logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens drawn from ``logp [N, V]`` (``-inf`` = never) at ``uniforms [N]`` in [0, 1) -> ``[N]`` long.

    Token ``i`` owns the interval ``[cdf[i-1], cdf[i])`` of the float64 running sum, so a token of
    probability 0 owns an empty interval and is never drawn. A uniform that rounds to the total
    mass (the interval end) falls to the last token with positive probability.
    """
    probs = logp.double().exp()
    cdf = probs.cumsum(dim=-1)
    targets = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    last_possible = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # argmax: the first column reaching the count
    return torch.minimum(picked, last_possible)


def sample_tokens(logits: torch.Tensor, rows: list[RowSampling]) -> list[Sampled]:
    """Draw one token for each row of ``logits [B, V]`` under that row's settings (``len(rows) == B``).

    One log-softmax (and one nucleus sort if some row has ``top_p < 1``) for the
    batch, one uniform number per stochastic row, one host transfer at the end.
    """
    device = logits.device
    # -inf is a token the model rules out; NaN, +inf or no finite logit at all is an overflow
    broken = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    if bool(broken.any()):
        raise NonFiniteLogits(f"the model's logits are not finite for {int(broken.sum())} of {len(rows)} rows: the "
                              "served weights or an activation overflowed")
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
    logp = nucleus_logprobs(logits, temperature, top_p)
    stochastic = [i for i, r in enumerate(rows) if r.temperature > GREEDY_TEMPERATURE]
    uniforms = [torch.rand(1, generator=rows[i].generator, dtype=torch.float64, device=device) for i in stochastic]
    if len(stochastic) == len(rows):
        tokens = inverse_cdf_draw(logp, torch.cat(uniforms))
    else:
        tokens = torch.argmax(logp, dim=-1)
        if stochastic:
            index = torch.tensor(stochastic, dtype=torch.long, device=device)
            tokens[index] = inverse_cdf_draw(logp[index], torch.cat(uniforms))
    picked_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if len(stochastic) < len(rows):  # greedy rows: the point mass chose them
        greedy = torch.tensor([r.temperature <= GREEDY_TEMPERATURE for r in rows], device=device)
        picked_logp = torch.where(greedy, torch.zeros_like(picked_logp), picked_logp)
    # Renormalising can round the log-probability of a near-certain token a hair
    # above 0; records refuse positive log-probabilities.
    return [(token, min(lp, 0.0), most_likely(logp[i], r.top_logprobs))
            for i, (token, lp, r) in enumerate(zip(tokens.tolist(), picked_logp.tolist(), rows))]


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
                 top_logprobs: int = 0) -> Sampled:
    """Draw one token from ``logits [V]`` (:func:`sample_tokens` for one row); returns ``(token_id,
    behaviour logprob, alternatives)`` where ``alternatives`` are the ``top_logprobs`` most likely
    tokens (:func:`most_likely`)."""
    return sample_tokens(logits.unsqueeze(0), [RowSampling(temperature, top_p, generator, top_logprobs)])[0]
