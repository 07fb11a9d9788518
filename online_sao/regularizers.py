"""Terms that keep the policy able to move (SAO.md section 3b; our addition, not in the paper).

A service whose preference changes must not let one answer mode take all the
probability, or the next preferred mode is never sampled and gives no signal:

- :func:`kl_penalty`: ``beta * k3`` with ``k3 = exp(d) - 1 - d``, ``d = log pi_ref - log pi_theta``
  per action token (k3 is a non-negative, unbiased estimate of KL(pi_theta || pi_ref) when the
  tokens are sampled from pi_theta; here they come from the engine's behaviour policy, which DIS
  keeps close to pi_theta);
- :func:`entropy_bonus`: ``-alpha * H(pi_theta)`` per action token, added to the loss (so
  minimising the loss raises the entropy).

Both are token sums divided by ``N`` exactly like the DIS loss (the batch's action-token count,
or the ``normalizer`` data-parallel ranks pass), and both return ``(loss, metrics)``. Tensors are
``[B, T]`` in the alignment of :mod:`online_sao.batch`; logits are ``[B, T, V]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from online_sao.losses import loss_normalizer, masked_mean


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    beta: float,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L = (beta / N) sum_t k3_t`` over action tokens, ``k3_t = exp(d_t) - 1 - d_t``,
    ``d_t = ref_logprobs_t - logprobs_t``. ``ref_logprobs`` carry no gradient.

    Off action tokens ``d`` is replaced by 0 before ``exp`` (k3 = 0 there, no gradient, and no
    overflow from padding). Metrics: ``kl_ref`` (mean k3 over action tokens, the estimate of
    KL(pi_theta || pi_ref) whatever beta is) and ``kl_loss`` (the weighted term).
    """
    d = ref_logprobs.detach() - logprobs
    d = torch.where(action_mask, d, torch.zeros_like(d))
    k3 = d.exp() - 1.0 - d
    loss = beta * k3.sum() / loss_normalizer(action_mask, normalizer)
    return loss, {"kl_ref": masked_mean(k3.detach(), action_mask), "kl_loss": float(loss.detach())}


def action_entropy(logits: torch.Tensor, action_mask: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` entropy of the sampling distribution of each action token, 0 elsewhere.

    Position ``t`` holds ``H(softmax(logits_{t-1} / temperature))`` (the distribution ``x_t`` was
    drawn from, as in :func:`online_sao.losses.token_logprobs`); ``temperature`` is ``[B]``.
    Only action positions are gathered before the softmax, so the float32 log-probabilities
    take ``[action tokens, V]``, not ``[B, T, V]``. Differentiable in ``logits``.
    """
    predicting = action_mask[:, 1:]  # logits at t - 1 predict token t
    scaled = logits[:, :-1].float() / temperature.to(logits.device, torch.float32).view(-1, 1, 1)
    picked = scaled[predicting]  # [n, V]
    logp = F.log_softmax(picked, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    rows, cols = predicting.nonzero(as_tuple=True)
    out = torch.zeros(action_mask.shape, dtype=entropy.dtype, device=logits.device)
    return out.index_put((rows, cols + 1), entropy)


def entropy_bonus(
    entropy: torch.Tensor, action_mask: torch.Tensor, alpha: float, normalizer: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L = -(alpha / N) sum_t H_t`` over action tokens (``entropy`` ``[B, T]`` from
    :func:`action_entropy`). Metrics: ``entropy`` (mean H over action tokens, whatever alpha
    is) and ``entropy_loss`` (the weighted term, <= 0)."""
    kept = torch.where(action_mask, entropy, torch.zeros_like(entropy))
    loss = -alpha * kept.sum() / loss_normalizer(action_mask, normalizer)
    return loss, {"entropy": masked_mean(entropy.detach(), action_mask), "entropy_loss": float(loss.detach())}


@torch.no_grad()
def ema_update_(reference: nn.Module, policy: nn.Module, rate: float) -> None:
    """``reference = (1 - rate) reference + rate policy``, parameter by parameter, in place.

    Both models must have the same parameters in the same order and layout (under FSDP both
    are sharded alike, so each rank updates its own shards)."""
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    ref_params, params = list(reference.parameters()), list(policy.parameters())
    if len(ref_params) != len(params):
        raise ValueError(f"reference has {len(ref_params)} parameters, policy {len(params)}")
    for ref, cur in zip(ref_params, params):
        ref.lerp_(cur.detach(), rate)
