"""Monitors of a policy's recent answers that do not trust the reward: length, repetition,
distance from the reference policy, the named scores behind the reward (a judge's quality), and
the share of records the learner could not use. Pure
functions over token lists and log-prob tensors; the registry's rollback rule and thresholds
live in trainer.deploy (``deploy.monitor_*``)."""

from __future__ import annotations

import math

import torch


def mean_answer_length(answers: list[list[int]]) -> float:
    """Mean number of sampled (action) tokens per answer; NaN without answers."""
    return sum(len(a) for a in answers) / len(answers) if answers else math.nan


def repeated_ngram_share(answers: list[list[int]], n: int) -> float:
    """Share of the answers' ``n``-grams that already occurred earlier in the same answer,
    pooled over answers (0: no repetition; close to 1: one phrase over and over). NaN when no
    answer has an ``n``-gram."""
    total = repeated = 0
    for answer in answers:
        seen: set[tuple[int, ...]] = set()
        for start in range(len(answer) - n + 1):
            gram = tuple(answer[start:start + n])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return repeated / total if total else math.nan


def mean_scores(scores: list[dict[str, float]]) -> dict[str, float]:
    """Per score name, the mean over the answers whose rewards carried that score (each answer's
    ``Rollout.scores``); a name no answer carries is absent."""
    values: dict[str, list[float]] = {}
    for answer_scores in scores:
        for name, value in answer_scores.items():
            values.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}


def dead_letter_share(dead_letters: float, records_read: float) -> float:
    """Dead-lettered records per record read over the same stretch; NaN when none was read."""
    return dead_letters / records_read if records_read > 0 else math.nan


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 action_mask: torch.Tensor) -> tuple[float, dict[str, float]]:
    """KL(pi || pi_ref) per action token, estimated on tokens sampled from (about) ``pi``.

    ``logprobs`` and ``ref_logprobs`` ``[B, T]``: each token's log-probability under the policy
    and the reference; ``action_mask`` ``[B, T]`` bool. With ``d = log pi_ref - log pi`` the value
    is the mean over action tokens of ``k3 = exp(d) - 1 - d`` (non-negative, unbiased when the
    tokens come from ``pi``, lower variance than ``-d``). A token either policy gives log-prob
    ``-inf`` (outside its top-p nucleus) is left out. Returns (k3 mean, metrics: ``kl_k1`` the
    plain mean of ``-d``, ``kl_tokens`` the tokens counted); NaN with no token."""
    counted = action_mask.bool() & torch.isfinite(logprobs) & torch.isfinite(ref_logprobs)
    n = int(counted.sum())
    if n == 0:
        return math.nan, {"kl_k1": math.nan, "kl_tokens": 0.0}
    d = (ref_logprobs.double() - logprobs.double())[counted]
    k3 = float((d.exp() - 1.0 - d).sum()) / n
    return k3, {"kl_k1": float(-d.sum()) / n, "kl_tokens": float(n)}
