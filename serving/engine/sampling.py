"""Drawing tokens from the engine's sampling distribution, a whole decode batch at a time.

The distribution itself, and the behaviour log-probability logged with each
token, is :func:`online_sao.sampling.nucleus_logprobs`: the learner recomputes
the same function under the current policy, so its importance ratio compares
against what really sampled the token.

A row is drawn by inverting its cumulative distribution at one uniform number
taken from the row's own generator (float64 throughout). This is an exact draw
from the row's distribution, costs one random number per token (not one per
vocabulary entry, as ``torch.multinomial``'s exponential race does), runs as one
tensor op for the batch, and keeps a seeded request's random numbers independent
of which other requests share its batch: its generator is consumed only by its
own rows. Its tokens are as independent as its logits are: in float32 a batch's
shape moves them by about 1e-6, too little to cross a token boundary in practice;
in bfloat16 it moves them enough that a seeded answer alone and in a batch can
differ (a hunt measured 1 to 10 of 32 seeded answers per cache layout).

``SamplingParams`` requires ``temperature > 0``. At or below
:data:`GREEDY_TEMPERATURE` the engine takes the arg-max instead of drawing (the
tempered distribution is a point mass up to float rounding, and drawing from it
would only turn rounding noise into different tokens). The distribution that
chose the token is then the point mass, and its log-probability, 0, is what is
logged (the learner evaluates the same point mass: online_sao/sampling.py). Both
halves of that rule are the learner's own, so that it scores the engine's token 0
and not -inf: a row is greedy when its temperature *as float32* (the dtype the
learner's batch carries, online_sao/batch.py) is at most the threshold, and its
token is the arg-max of the raw logits (dividing by 1e-4 can round two adjacent
float32 logits to one value, whose arg-max is then the lower id). A greedy row's
alternatives (``top_logprobs``) are still those of the tempered nucleus
distribution: the point mass would list the chosen token alone.

Non-finite logits (weights or activations that overflowed) fail requests with
:class:`NonFiniteLogits`, naming the cause, instead of drawing token 0 with a NaN
log-probability that no record accepts: the whole batch, or with ``rows_apart``
(a batch whose rows cannot see each other) the broken rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from online_sao.sampling import GREEDY_TEMPERATURE, nucleus_logprobs

__all__ = ["GREEDY_TEMPERATURE", "NonFiniteLogits", "RowSampling", "inverse_cdf_draw", "most_likely",
           "nucleus_logprobs", "sample_token", "sample_tokens"]


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
    """How many of the most likely tokens to return beside the sampled one: under the tempered nucleus
    distribution, a greedy row's too (its point mass would list the chosen token alone)."""


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


def non_finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the rows of ``logits [B, V]`` nothing can be drawn from."""
    # -inf is a token the model rules out; NaN, +inf or no finite logit at all is an overflow
    return torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)


def sample_tokens(logits: torch.Tensor, rows: list[RowSampling],
                  rows_apart: bool = False) -> list[Sampled | NonFiniteLogits]:
    """Draw one token for each row of ``logits [B, V]`` under that row's settings (``len(rows) == B``).

    One log-softmax (and one nucleus sort if some row has ``top_p < 1``) for the
    batch, one uniform number per stochastic row, one host transfer at the end.

    Rows whose logits are not finite: :class:`NonFiniteLogits` is raised for the batch; with
    ``rows_apart`` (rows that cannot see each other, each its own sequence, as in the padded cache
    layout) a broken row gets a :class:`NonFiniteLogits` in its place instead, and the other rows
    are drawn as they would be without it (each consumes only its own generator).
    """
    broken = non_finite_rows(logits).tolist()
    if not any(broken):
        return _draw(logits, rows)
    if not rows_apart:
        raise NonFiniteLogits(f"the model's logits are not finite for {sum(broken)} of {len(rows)} rows: the "
                              "served weights or an activation overflowed")
    fine = [i for i, bad in enumerate(broken) if not bad]
    drawn = iter(_draw(logits[fine], [rows[i] for i in fine]) if fine else [])
    return [NonFiniteLogits(f"the model's logits are not finite for this request's row ({sum(broken)} of "
                            f"{len(rows)} rows): the served weights or an activation overflowed")
            if bad else next(drawn) for bad in broken]


def _draw(logits: torch.Tensor, rows: list[RowSampling]) -> list[Sampled]:
    """:func:`sample_tokens` for finite ``logits``."""
    device = logits.device
    # greedy exactly as the learner decides it (online_sao/sampling.py, sampled_logprobs and
    # decodes_greedily): the same comparison on the float32 temperature its batch holds. On the Python float, a temperature a hair
    # above GREEDY_TEMPERATURE (the API takes 1.00000001e-4) was drawn and logged with a tempered
    # log-prob, while the learner, for which it rounds to 1e-4, scored that token 0 or -inf.
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32)  # host: reading it costs no sync
    greedy = temperature <= GREEDY_TEMPERATURE
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
    logp = nucleus_logprobs(logits, temperature.to(device), top_p)
    stochastic = [i for i, g in enumerate(greedy.tolist()) if not g]
    uniforms = [torch.rand(1, generator=rows[i].generator, dtype=torch.float64, device=device) for i in stochastic]
    if len(stochastic) == len(rows):
        tokens = inverse_cdf_draw(logp, torch.cat(uniforms))
    else:
        # greedy rows: the arg-max of the raw logits, the learner's. That of the tempered ones is
        # not it where dividing by the temperature rounded the two largest logits to one value (a
        # tie the arg-max gives the lower id, however the raw logits are ordered).
        tokens = torch.argmax(logits, dim=-1)
        if stochastic:
            index = torch.tensor(stochastic, dtype=torch.long, device=device)
            tokens[index] = inverse_cdf_draw(logp[index], torch.cat(uniforms))
    picked_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if len(stochastic) < len(rows):  # greedy rows: the point mass chose them
        picked_logp = torch.where(greedy.to(device), torch.zeros_like(picked_logp), picked_logp)
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
