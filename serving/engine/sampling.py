"""The engine's sampling distribution and the behaviour log-probability of a sample.

The distribution a token is drawn from is ``softmax(logits / temperature)``
restricted to the nucleus (the smallest set of most likely tokens whose mass
reaches ``top_p``) and renormalised. The behaviour log-probability logged with a
token is its log-probability under exactly that distribution, so a learner's
importance ratio compares against what really sampled it.

``SamplingParams`` requires ``temperature > 0``. At or below
:data:`GREEDY_TEMPERATURE` the engine takes the arg-max instead of drawing (the
tempered distribution is a point mass up to float rounding, and drawing from it
would only turn rounding noise into different tokens); the logged
log-probability is still the arg-max token's under the tempered, filtered
distribution (about 0).
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 1e-4
"""Temperatures at or below this decode greedily (see the module docstring)."""


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the sampling distribution of one position.

    Args:
        logits: ``[V]`` raw logits of the model.
        temperature: > 0.
        top_p: in (0, 1]; 1 keeps every token.

    Returns:
        ``[V]`` float32 log-probabilities, ``-inf`` outside the nucleus; they
        sum (in probability) to 1 over the nucleus.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, descending=True)
    probs = sorted_logp.exp()
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # Keep a token while the mass of the more likely tokens is still short of
    # top_p; the most likely token is always kept.
    keep_sorted = mass_before < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
    kept = logp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1)


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
