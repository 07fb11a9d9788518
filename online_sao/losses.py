"""Pure loss functions of the learning rules (SAO.md sections 1, 3 and 4).

Every tensor is ``[B, T]`` and follows the token alignment of
:mod:`online_sao.batch`: position ``t`` describes token ``x_t``. ``action_mask``
is bool; only action tokens enter a loss. Each loss returns ``(loss, metrics)``
with ``metrics`` plain floats.

The token mean divides by ``N``: the number of action tokens of the batch, or the
``normalizer`` the caller passes (data-parallel ranks pass the global count, see
:attr:`online_sao.batch.RolloutBatch.token_normalizer`). Masked tokens stay in N.

Outside the nucleus. With ``top_p < 1`` the current policy's log-probability of a
token is ``-inf`` when its nucleus no longer holds that token (see
:mod:`online_sao.sampling`). Its ratio is 0: every loss masks it out (DIS because 0
is below the band; the clipped surrogate explicitly, since ``-inf - -inf`` against
pi_old is not a number) and reports the share as ``outside_nucleus_frac``; the
ratio metrics (``ratio_mean``, ``approx_kl``) average over the other action tokens.
No gradient reaches it: its log-ratio is replaced by a constant before ``exp``.

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

import torch

from online_sao.sampling import GREEDY_TEMPERATURE, nucleus_logprobs, sampled_logprobs

MIN_NORMALIZER = 1.0
"""Floor of N: a batch without action tokens gives loss 0 instead of 0/0."""
MIN_EXPLAINABLE_VARIANCE = 1e-6
"""Variance of the returns at or below which explained variance is undefined (NaN). Returns that
agree to about 1e-3 (a step whose rollouts all scored near 0) leave nothing to explain, and
dividing by their variance gave per-step values like -4e7 that swamp any summary of a run."""


def loss_normalizer(action_mask: torch.Tensor, normalizer: float | None) -> torch.Tensor | float:
    """N of the token-mean losses (module docstring): ``normalizer`` when given, else the
    action-token count of ``action_mask`` (at least MIN_NORMALIZER)."""
    if normalizer is not None:
        if not normalizer > 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return float(normalizer)
    return action_mask.sum().clamp_min(MIN_NORMALIZER)


def _fraction(flags: torch.Tensor, action_mask: torch.Tensor) -> float:
    count = int(action_mask.sum())
    return float((flags & action_mask).sum()) / count if count else 0.0


def masked_mean(x: torch.Tensor, action_mask: torch.Tensor) -> float:
    """Mean of ``x`` over the action tokens as a float (0.0 when there are none); a metric, no grad."""
    count = int(action_mask.sum())
    return float(torch.where(action_mask, x, torch.zeros_like(x)).sum()) / count if count else 0.0


def _ratio_metrics(log_ratio: torch.Tensor, logprobs: torch.Tensor, action_mask: torch.Tensor) -> dict[str, float]:
    """Mean ratio and approx KL, mean of (r - 1) - log r, over the action tokens whose
    log-ratio is finite, and the share of action tokens outside the current nucleus."""
    with torch.no_grad():
        inside = action_mask & torch.isfinite(log_ratio)
        log_ratio = torch.where(inside, log_ratio, torch.zeros_like(log_ratio))
        ratio = log_ratio.exp()
        return {
            "ratio_mean": masked_mean(ratio, inside),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, inside),
            "outside_nucleus_frac": _fraction(torch.isneginf(logprobs), action_mask),
        }


def dis_band_mask(
    log_ratio: torch.Tensor, action_mask: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """DIS keep mask (SAO.md section 1): action tokens with 1 - eps_low < r < 1 + eps_high.

    Strict on both edges. A non-finite ratio (NaN) fails both comparisons and is masked.
    Computed without gradient: the mask selects tokens, it is never differentiated.
    """
    with torch.no_grad():
        ratio = log_ratio.detach().exp()
        return action_mask & (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)


def dis_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct double-sided importance sampling loss (SAO.md section 1).

    ``r_t = exp(logprobs_t - rollout_logprobs_t)``; ``m_t`` keeps a token only when
    ``1 - eps_low < r_t < 1 + eps_high``; ``L = -(1/N) sum_t m_t r_t A_t``.
    The gradient of a kept token is ``r_t A_t grad log pi / N``; a masked token
    contributes exactly zero gradient whatever the sign of ``A_t`` (its log-ratio
    is replaced by a constant before ``exp``, so not even ``0 * inf`` can leak).

    Shapes: all ``[B, T]``; ``advantages`` and ``rollout_logprobs`` carry no grad.
    Metrics: kept_frac, masked_below_frac (r <= 1 - eps_low, tokens outside the
    current nucleus included), masked_above_frac (r >= 1 + eps_high),
    masked_nan_frac (r not a number), outside_nucleus_frac, ratio_mean and approx_kl
    (see the module docstring).
    """
    log_ratio = logprobs - rollout_logprobs.detach()
    kept = dis_band_mask(log_ratio, action_mask, eps_low, eps_high)
    zeros = torch.zeros_like(log_ratio)
    ratio = torch.where(kept, log_ratio, zeros).exp()
    surrogate = torch.where(kept, ratio * advantages.detach(), zeros)
    loss = -surrogate.sum() / loss_normalizer(action_mask, normalizer)

    with torch.no_grad():
        raw_ratio = log_ratio.detach().exp()
        metrics = {
            "kept_frac": _fraction(kept, action_mask),
            "masked_below_frac": _fraction(raw_ratio <= 1.0 - eps_low, action_mask),
            "masked_above_frac": _fraction(raw_ratio >= 1.0 + eps_high, action_mask),
            "masked_nan_frac": _fraction(torch.isnan(raw_ratio), action_mask),
            **_ratio_metrics(log_ratio.detach(), logprobs.detach(), action_mask),
        }
    return loss, metrics


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    rollout_logprobs: torch.Tensor | None = None,
    eps_low: float | None = None,
    eps_high: float | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate against pi_old (SAO.md section 4, grpo and ppo baselines).

    ``rho_t = exp(logprobs_t - old_logprobs_t)``;
    ``L = -(1/N) sum_t d_t min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t)``.
    ``d_t`` is 1 unless ``rollout_logprobs`` is given: then it is the DIS band mask
    of ``exp(logprobs_t - rollout_logprobs_t)`` with ``eps_low``/``eps_high`` ("GRPO
    with DIS"). A token outside the current or pi_old's nucleus (log-prob ``-inf``)
    is masked out (module docstring). Shapes: all ``[B, T]``.
    Metrics: clip_frac (the share of the tokens that enter the loss, ``d_t`` 1 and inside both
    nuclei, where the clipped branch is taken; 0 without such a token), ratio_mean, approx_kl
    against pi_old and outside_nucleus_frac; with DIS also kept_frac.
    """
    old = old_logprobs.detach()
    adv = advantages.detach()
    log_ratio = logprobs - old
    zeros = torch.zeros_like(log_ratio)
    inside = action_mask & torch.isfinite(logprobs.detach()) & torch.isfinite(old)
    ratio = torch.where(inside, log_ratio, zeros).exp()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    unclipped_term, clipped_term = ratio * adv, clipped * adv
    surrogate = torch.minimum(unclipped_term, clipped_term)
    keep = inside
    metrics: dict[str, float] = {}
    if rollout_logprobs is not None:
        if eps_low is None or eps_high is None:
            raise ValueError("the DIS mask needs eps_low and eps_high")
        keep = inside & dis_band_mask(logprobs - rollout_logprobs.detach(), action_mask, eps_low, eps_high)
        metrics["kept_frac"] = _fraction(keep, action_mask)
    loss = -torch.where(keep, surrogate, zeros).sum() / loss_normalizer(action_mask, normalizer)
    with torch.no_grad():
        # over the tokens the loss takes: one DIS dropped has no clipped branch to take
        metrics["clip_frac"] = _fraction((clipped_term < unclipped_term) & keep, keep)
        metrics.update(_ratio_metrics(log_ratio.detach(), logprobs.detach(), action_mask))
    return loss, metrics


def value_loss(
    values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor, normalizer: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss (SAO.md section 3): ``(1/N) sum_t (V_t - G_t)^2`` over action tokens.

    Shapes: ``[B, T]``; ``returns`` carry no grad. Metrics: value_mean, return_mean
    and explained_variance over action tokens.
    """
    target = returns.detach()
    err = torch.where(action_mask, values - target, torch.zeros_like(values))
    loss = err.pow(2).sum() / loss_normalizer(action_mask, normalizer)
    with torch.no_grad():
        metrics = {
            "value_mean": masked_mean(values.detach(), action_mask),
            "return_mean": masked_mean(target, action_mask),
            "explained_variance": explained_variance(values.detach(), target, action_mask),
        }
    return loss, metrics


def endpoint_squared_errors(values: torch.Tensor, returns: torch.Tensor,
                            action_mask: torch.Tensor) -> dict[str, float]:
    """The critic's squared error at each rollout's first and at its last action token.

    Shapes ``[B, T]``. Metrics ``value_loss_first`` and ``value_loss_last``: the mean over rows
    with action tokens of ``(V - G)^2`` at the row's first / last action token (NaN when no row has
    one). The first is the critic's prediction from the prompt alone, the last after reading the
    whole answer: apart, they show how much of the reward the critic reads from the answer
    itself, which is what token-level credit (small GAE lambda) needs.
    """
    rows = action_mask.any(dim=1)
    if not bool(rows.any()):
        return {"value_loss_first": float("nan"), "value_loss_last": float("nan")}
    positions = torch.arange(action_mask.shape[1], device=action_mask.device).expand_as(action_mask)
    first = torch.where(action_mask, positions, action_mask.shape[1]).min(dim=1).values[rows]
    last = torch.where(action_mask, positions, -1).max(dim=1).values[rows]
    err = (values.detach() - returns.detach()).double()[rows]
    picked = torch.arange(err.shape[0], device=err.device)
    return {"value_loss_first": float(err[picked, first].square().mean()),
            "value_loss_last": float(err[picked, last].square().mean())}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor) -> float:
    """``1 - Var(G - V) / Var(G)`` over action tokens; NaN when there are fewer than 2 tokens or
    Var(G) is at most MIN_EXPLAINABLE_VARIANCE (undefined)."""
    v = values[action_mask].double()
    g = returns[action_mask].double()
    if g.numel() < 2:
        return float("nan")
    var_g = g.var(unbiased=False)
    if var_g <= MIN_EXPLAINABLE_VARIANCE:
        return float("nan")
    return float(1.0 - (g - v).var(unbiased=False) / var_g)


def nucleus_entropy(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[n]`` entropy of the sampling distribution of each of ``[n, V]`` logits (temperature and
    top-p ``[n]``; over the nucleus when ``top_p < 1``). Differentiable in ``logits``. A greedy
    temperature (``GREEDY_TEMPERATURE``) samples the point mass at the arg-max, as in
    :func:`online_sao.sampling.sampled_logprobs`: entropy 0, no gradient."""
    temperature = temperature.to(logits.device)
    logp = nucleus_logprobs(logits, temperature, top_p.to(logits.device))
    # outside the nucleus p = 0: its term is 0, and -inf must not meet 0 (0 * -inf is not a number)
    entropy = -(logp.exp() * logp.masked_fill(torch.isneginf(logp), 0.0)).sum(dim=-1)
    return torch.where(temperature <= GREEDY_TEMPERATURE, 0.0, entropy)


def action_entropy(logits: torch.Tensor, action_mask: torch.Tensor, temperature: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` entropy of the sampling distribution of each action token, 0 elsewhere.

    Aligned as :func:`token_logprobs` (``temperature`` and ``top_p`` ``[B, T]`` likewise): position
    ``t`` holds :func:`nucleus_entropy` of ``logits_{t-1}``, the distribution ``x_t`` was drawn
    from. Only action positions are gathered before the softmax, so the float32
    log-probabilities take ``[action tokens, V]``, not ``[B, T, V]``. Differentiable in ``logits``.
    """
    predicting = action_mask[:, 1:]  # logits at t - 1 predict token t
    entropy = nucleus_entropy(logits[:, :-1][predicting], temperature[:, 1:][predicting],
                              top_p[:, 1:][predicting])
    rows, cols = predicting.nonzero(as_tuple=True)
    out = torch.zeros(action_mask.shape, dtype=entropy.dtype, device=logits.device)
    return out.index_put((rows, cols + 1), entropy)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities under the distribution each token was sampled from.

    ``logits`` ``[B, T, V]`` from the model run on ``input_ids`` ``[B, T]``;
    ``temperature`` and ``top_p`` ``[B, T]``: the sampling settings of token ``x_t``
    at position ``t`` (meaningful on action tokens; in packed rows, which hold several
    rollouts, each token keeps its own). Returns ``[B, T]``: position ``t``
    holds :func:`online_sao.sampling.nucleus_logprobs` of ``logits_{t-1}`` at ``x_t``
    (the logits at ``t - 1`` predict ``x_t``), the engine's own definition, so ``-inf``
    for a token outside the nucleus; position 0 holds 0 (see :mod:`online_sao.batch`).
    """
    shifted = sampled_logprobs(logits[:, :-1], input_ids[:, 1:], temperature[:, 1:], top_p[:, 1:])
    first = torch.zeros((input_ids.shape[0], 1), dtype=torch.float32, device=logits.device)
    return torch.cat([first, shifted], dim=1)
