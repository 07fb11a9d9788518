"""Drawing a token from the engine's sampling distribution.

The distribution itself, and the behaviour log-probability logged with each
token, is :func:`online_sao.sampling.nucleus_logprobs`: the learner recomputes
the same function under the current policy, so its importance ratio compares
against what really sampled the token.

``SamplingParams`` requires ``temperature > 0``. At or below
:data:`GREEDY_TEMPERATURE` the engine takes the arg-max instead of drawing (the
tempered distribution is a point mass up to float rounding, and drawing from it
would only turn rounding noise into different tokens); the logged
log-probability is still the arg-max token's under the tempered, filtered
distribution (about 0).
"""

from __future__ import annotations

import torch

from online_sao.sampling import nucleus_logprobs

__all__ = ["GREEDY_TEMPERATURE", "most_likely", "nucleus_logprobs", "sample_token"]

GREEDY_TEMPERATURE = 1e-4
"""Temperatures at or below this decode greedily (see the module docstring)."""


def most_likely(logp: torch.Tensor, count: int) -> tuple[tuple[int, float], ...]:
    """The ``count`` most likely tokens of ``logp [V]`` as ``(token_id, logprob)``, most likely first;
    tokens outside the nucleus (``-inf``) are left out, so there may be fewer."""
    if count <= 0:
        return ()
    values, ids = torch.topk(logp, min(count, logp.shape[-1]))
    return tuple((int(i), min(float(v), 0.0)) for v, i in zip(values, ids) if torch.isfinite(v))


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
                 top_logprobs: int = 0) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """Draw one token from ``logits [V]``; returns ``(token_id, behaviour logprob, alternatives)`` where
    ``alternatives`` are the ``top_logprobs`` most likely tokens (:func:`most_likely`)."""
    logp = nucleus_logprobs(logits, temperature, top_p)
    if temperature <= GREEDY_TEMPERATURE:
        token = int(torch.argmax(logp))
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    # Renormalising can round the log-probability of a near-certain token a hair
    # above 0; records refuse positive log-probabilities.
    return token, min(float(logp[token]), 0.0), most_likely(logp, top_logprobs)
