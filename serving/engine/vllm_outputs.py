"""One request's step output from vLLM (``{token_id: Logprob}`` per position) read as the native engine
reports it: the alternatives, greedy positions re-tempered, and whether every value is usable."""

from __future__ import annotations

import math

import torch

from serving.engine.sampling import nucleus_logprobs


def ranked(logprobs: dict) -> list[tuple[int, float]]:
    """One position of vLLM's output (``{token_id: Logprob}``: the top ``count`` plus the sampled token
    when it is not among them) as ``(token_id, logprob)``, most likely first, ties to the lower id."""
    return sorted(((int(t), float(lp.logprob)) for t, lp in logprobs.items()), key=lambda item: (-item[1], item[0]))


def alternatives(logprobs: dict, count: int) -> tuple[tuple[int, float], ...]:
    """The ``count`` most likely tokens of one position of vLLM's output, leaving out tokens outside
    the nucleus (-inf)."""
    return tuple((t, min(lp, 0.0)) for t, lp in ranked(logprobs)[:count] if math.isfinite(lp))


def greedy_alternatives(logprobs: dict, temperature: float, top_p: float,
                         count: int) -> tuple[tuple[int, float], ...]:
    """The alternatives of a greedy position, as the native engine lists them: under the request's own
    tempered nucleus distribution (``sample_tokens`` takes the arg-max but lists ``nucleus_logprobs``).

    vLLM reports a greedy row's log-probabilities at temperature 1 without a nucleus, so they are
    re-tempered here over the tokens it listed. Tokens beyond the list are left out of the normaliser;
    at a greedy temperature that moves the values only where an unlisted token's logit is within about
    ``temperature * ln(vocabulary)`` of the largest one (a near tie).
    """
    if count <= 0:
        return ()
    listed = ranked(logprobs)
    logp = nucleus_logprobs(torch.tensor([lp for _, lp in listed]), temperature, top_p).tolist()
    return tuple((t, min(lp, 0.0)) for (t, _), lp in zip(listed[:count], logp) if math.isfinite(lp))


def finite_output(completion) -> bool:
    """Whether every position of one request's step output has a finite sampled log-probability and no
    NaN or +inf among its alternatives (-inf is a token outside the nucleus)."""
    for token, logprobs in zip(completion.token_ids, completion.logprobs or []):
        if not math.isfinite(logprobs[token].logprob):
            return False
        if any(math.isnan(lp.logprob) or lp.logprob == math.inf for lp in logprobs.values()):
            return False
    return True
