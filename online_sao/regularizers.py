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
``[B, T]`` in the alignment of :mod:`online_sao.batch`; the entropy per action token comes from
:func:`online_sao.losses.action_entropy` (in :func:`online_sao.train_step.policy_forward`).
:class:`PolicyRegularizer` adds the configured terms to a rule's policy loss.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from online_sao.batch import RolloutBatch
from online_sao.config import AlgorithmConfig
from online_sao.losses import loss_normalizer, masked_mean
from online_sao.train_step import policy_logprobs


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    beta: float,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L = (beta / N) sum_t k3_t`` over action tokens, ``k3_t = exp(d_t) - 1 - d_t``,
    ``d_t = ref_logprobs_t - logprobs_t``. ``ref_logprobs`` carry no gradient.

    Off action tokens, and on a token outside the top-p nucleus of either policy (log-prob
    ``-inf``, see :mod:`online_sao.sampling`), ``d`` is replaced by 0 before ``exp`` (k3 = 0
    there, no gradient, and no overflow from padding or ``inf - inf``). Metrics: ``kl_ref`` (mean
    k3 over the other action tokens, the estimate of KL(pi_theta || pi_ref) whatever beta is) and
    ``kl_loss`` (the weighted term).
    """
    ref = ref_logprobs.detach()
    counted = action_mask & torch.isfinite(logprobs.detach()) & torch.isfinite(ref)
    d = torch.where(counted, ref - logprobs, torch.zeros_like(logprobs))
    k3 = d.exp() - 1.0 - d
    loss = beta * k3.sum() / loss_normalizer(action_mask, normalizer)
    return loss, {"kl_ref": masked_mean(k3.detach(), counted), "kl_loss": float(loss.detach())}


def entropy_bonus(
    entropy: torch.Tensor, action_mask: torch.Tensor, alpha: float, normalizer: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L = -(alpha / N) sum_t H_t`` over action tokens (``entropy`` ``[B, T]`` from
    :func:`~online_sao.losses.action_entropy`). Metrics: ``entropy`` (mean H over action tokens, whatever alpha
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
    for module in (reference, policy):
        if isinstance(module, FSDPModule):  # a forward may leave the root's parameters gathered
            module.reshard()
    ref_params, params = list(reference.parameters()), list(policy.parameters())
    if len(ref_params) != len(params):
        raise ValueError(f"reference has {len(ref_params)} parameters, policy {len(params)}")
    for ref, cur in zip(ref_params, params):
        ref.lerp_(cur.detach(), rate)


def build_reference(cfg: AlgorithmConfig, policy: nn.Module) -> nn.Module | None:
    """A frozen copy of ``policy`` (in eval mode) when the KL penalty is on, else None. Call it
    before the policy is sharded or trained: the copy is the starting policy. It costs one more
    model copy of memory (and a forward pass per step): fine for small models, to plan for big ones."""
    if cfg.kl_beta == 0:
        return None
    reference = copy.deepcopy(policy).eval()
    reference.requires_grad_(False)
    return reference


class PolicyRegularizer:
    """The configured section-3b terms of a policy loss; adds nothing when both weights are 0.

    ``reference`` (from :func:`build_reference`) is required when ``cfg.kl_beta > 0``.
    """

    def __init__(self, cfg: AlgorithmConfig, reference: nn.Module | None = None) -> None:
        if cfg.kl_beta > 0 and reference is None:
            raise ValueError("algorithm.kl_beta > 0 needs a reference policy")
        self.cfg = cfg
        self.reference = reference

    @property
    def needs_entropy(self) -> bool:
        """Whether :meth:`loss` needs the policy's entropy per action token."""
        return self.cfg.entropy_alpha > 0

    def loss(self, batch: RolloutBatch, logprobs: torch.Tensor,
             entropy: torch.Tensor | None) -> tuple[torch.Tensor | float, dict[str, float]]:
        """The terms for the policy's token ``logprobs`` ``[B, T]`` on ``batch`` and its ``entropy``
        ``[B, T]`` per action token (None unless :attr:`needs_entropy`), both from one forward
        pass, with gradient. Metrics: kl_ref and kl_loss with the KL penalty, entropy and
        entropy_loss with the bonus."""
        total: torch.Tensor | float = 0.0
        metrics: dict[str, float] = {}
        normalizer = batch.token_normalizer
        if self.cfg.kl_beta > 0:
            with torch.no_grad():
                ref_logprobs = policy_logprobs(self.reference, batch)
            kl, kl_metrics = kl_penalty(logprobs, ref_logprobs, batch.action_mask, self.cfg.kl_beta, normalizer)
            total, metrics = total + kl, {**metrics, **kl_metrics}
        if self.cfg.entropy_alpha > 0:
            bonus, bonus_metrics = entropy_bonus(entropy, batch.action_mask, self.cfg.entropy_alpha, normalizer)
            total, metrics = total + bonus, {**metrics, **bonus_metrics}
        return total, metrics

    def after_policy_update(self, policy: nn.Module) -> None:
        """Call after every applied policy update: moves an EMA reference toward ``policy``."""
        if self.cfg.kl_beta > 0 and self.cfg.kl_reference == "ema":
            ema_update_(self.reference, policy, self.cfg.kl_ema_rate)
