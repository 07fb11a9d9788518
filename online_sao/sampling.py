"""The sampling distribution of a token, one definition for the engine and the learner.

A token is drawn from ``softmax(logits / temperature)`` restricted to the top-p
nucleus and renormalised. The serving engine logs the drawn token's
log-probability under exactly this distribution (the behaviour log-probability)
and the learner recomputes it under the current policy for the importance ratio;
both call :func:`nucleus_logprobs`, so the two agree up to float rounding of the
logits themselves.

The nucleus rule: sort the tempered probabilities in decreasing order, ties
broken by the lower token id (a stable sort), and keep a token while the mass of
the tokens before it is still below ``top_p``; the most likely token is always
kept. ``top_p >= 1`` keeps every token (also those after the float32 running sum
has rounded to 1).

A token outside the nucleus has log-probability ``-inf``. The engine never draws
one; the learner can see one when the current policy's nucleus no longer holds a
token an older policy sampled (see :mod:`online_sao.losses`: such a token is
masked out of every loss and counted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GREEDY_TEMPERATURE = 1e-4
"""At or below this temperature the engines take the arg-max instead of drawing: the tempered
distribution is a point mass up to float rounding, and drawing from it would only turn rounding noise
into different tokens. The distribution that chose the token is then the point mass (log-probability 0
at the arg-max, -inf elsewhere), and :func:`sampled_logprobs` evaluates that one too: under the tempered
distribution a near tie (logits within about 1e-3, common in bfloat16) gave the arg-max about 1/2, so
the importance ratio against the engine's logged 0 was about 1/2 with identical weights."""


def decodes_greedily(temperature: float) -> bool:
    """Whether a request at ``temperature`` is decoded greedily, as :func:`sampled_logprobs` decides it:
    on the float32 temperature the learner's batch holds (online_sao/batch.py). On the Python float a
    temperature a hair above :data:`GREEDY_TEMPERATURE` (1.00000001e-4, which the API accepts) was
    drawn, while the learner, for which it is 1e-4, scored the token as the point mass's."""
    return bool(torch.tensor(temperature, dtype=torch.float32) <= GREEDY_TEMPERATURE)


def nucleus_mask(logprobs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Which tokens the top-p nucleus keeps.

    Args:
        logprobs: ``[..., V]`` log-probabilities of the full tempered distribution.
        top_p: a float, or ``[...]`` (one per distribution), in (0, 1].

    Returns:
        ``[..., V]`` bool, True on kept tokens. Computed without gradient (the set is
        a selection, never differentiated).
    """
    with torch.no_grad():
        sorted_logp, order = torch.sort(logprobs.detach(), dim=-1, descending=True, stable=True)
        probs = sorted_logp.exp()
        mass_before = torch.cumsum(probs, dim=-1) - probs
        threshold = top_p.to(probs.dtype).unsqueeze(-1) if torch.is_tensor(top_p) else torch.tensor(float(top_p))
        # top_p 1 keeps every token even where the running sum rounds to 1 before the tail ends
        keep_sorted = (mass_before < threshold) | (threshold >= 1.0)
        keep_sorted[..., 0] = True
        return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def nucleus_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor,
                     top_p: float | torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the sampling distribution.

    Args:
        logits: ``[..., V]`` raw logits of the model.
        temperature: a float > 0, or ``[...]`` (one per distribution).
        top_p: a float in (0, 1], or ``[...]``.

    Returns:
        ``[..., V]`` float32 log-probabilities, ``-inf`` outside the nucleus; they sum
        (in probability) to 1 over the nucleus. Differentiable in ``logits``.
    """
    scale = temperature.to(torch.float32).unsqueeze(-1) if torch.is_tensor(temperature) else float(temperature)
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    if bool(top_p >= 1.0) if not torch.is_tensor(top_p) else bool((top_p >= 1.0).all()):
        return logp  # no nucleus anywhere: skip the sort
    kept = logp.masked_fill(~nucleus_mask(logp, top_p), float("-inf"))
    norm = torch.logsumexp(kept, dim=-1, keepdim=True)
    if torch.is_tensor(top_p):
        # a distribution without a nucleus keeps log_softmax's values as they are, exactly as it
        # does alone (its logsumexp is 0 only up to rounding: one ulp apart on some CPUs)
        norm = torch.where((top_p >= 1.0).unsqueeze(-1), torch.zeros_like(norm), norm)
    return kept - norm


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """:func:`nucleus_logprobs` at ``tokens``: ``[..., V]`` logits and ``[...]`` tokens,
    temperatures and top-p values -> ``[...]``.

    At a temperature of at most :data:`GREEDY_TEMPERATURE` the distribution is the point mass at the
    arg-max, as the engines decode it. Distributions with ``top_p >= 1`` go through the fused
    cross-entropy (no ``[..., V]`` log-probability tensor is kept for them); only those with a
    nucleus pay for the sort and keep their full log-probabilities for backward.
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature.to(logits.device, torch.float32).unsqueeze(-1)
    out = -F.cross_entropy(scaled.reshape(-1, vocab), tokens.reshape(-1), reduction="none").view(tokens.shape)
    nucleus = top_p < 1.0
    if bool(nucleus.any()):
        picked = nucleus_logprobs(logits[nucleus], temperature[nucleus], top_p[nucleus])
        picked = picked.gather(-1, tokens[nucleus].unsqueeze(-1)).squeeze(-1)
        out = out.masked_scatter(nucleus.to(out.device), picked)
    greedy = (temperature <= GREEDY_TEMPERATURE).to(out.device)
    if bool(greedy.any()):  # the point mass at the arg-max (GREEDY_TEMPERATURE): no gradient
        point = torch.where(tokens == logits.argmax(dim=-1), 0.0, -torch.inf)
        out = torch.where(greedy, point, out)
    return out
