"""Advantages: skip-observation token-level GAE and length-adaptive lambda (SAO.md section 2).

Tensors are ``[B, T]`` in the token alignment of :mod:`online_sao.batch`. GAE
runs over the action tokens of each row only: they are packed to the left of a
``[B, L]`` tensor (``L`` the largest action count), the backward recursion is
solved there, and the result is scattered back. Inputs are treated as
constants (no gradient flows through advantages or returns).

Whitening is the one step-wide statistic here: under FSDP each rank holds a share of the
step, so :func:`whiten` takes a :data:`SumOverRanks` (all-reduced by
:func:`trainer.distributed.rank_sum`) to use the moments of the whole step.

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

GAE_BLOCK = 128
"""Action tokens per block of the GAE solve. Within a block the recursion is one
batched matrix product (memory B * L * GAE_BLOCK); blocks are chained from the end,
so there is one Python step per GAE_BLOCK action tokens, not one per token."""

LAMBDA_MIN = 0.0
"""Floor of length-adaptive lambda. 1 - 1/(alpha * l) is negative for l < 1/alpha
(l = 0, or l = 1 with alpha < 1); a negative lambda would flip the sign of credit
from later tokens, so such rollouts fall back to one-step TD (lambda = 0)."""

WHITEN_EPS = 1e-8
"""Added to the standard deviation when whitening, so a batch of equal advantages
divides by a small number instead of zero."""


SumOverRanks = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 tensor elementwise over the learner's ranks: every rank calls it at the same
point with a tensor of the same shape and gets back the sum of all ranks' tensors."""


def local_sum(values: torch.Tensor) -> torch.Tensor:
    """The :data:`SumOverRanks` of a single process: its own values."""
    return values


def length_adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """lambda_policy = 1 - 1/(alpha * l) per rollout, clamped to [LAMBDA_MIN, 1].

    ``num_action_tokens`` ``[B]`` (l of each rollout) -> ``[B]`` float32.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    length = torch.as_tensor(num_action_tokens).to(torch.float32)
    return (1.0 - 1.0 / (alpha * length)).clamp(LAMBDA_MIN, 1.0)


def _discounted_suffix_sum(delta: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``A_j = sum_{k >= j} decay^(k - j) delta_k`` per row. ``delta`` ``[B, L]``, ``decay`` ``[B]``.

    Equivalent to the backward recursion ``A_j = delta_j + decay * A_{j+1}``. Note
    that a non-finite delta makes its whole block non-finite (0 * inf), which is
    fine: a step with non-finite advantages is refused by the caller.
    """
    with torch.autocast(delta.device.type, enabled=False):
        return _suffix_sum_blocks(delta, decay)


def _suffix_sum_blocks(delta: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """:func:`_discounted_suffix_sum` outside autocast: the one-process learner runs its whole step
    under bfloat16 autocast (trainer/startup.py), and ``bmm`` is an op autocast lowers, which rounded
    every block sum to 8 bits of mantissa (critic targets of exactly 1 came out up to 1.0019)."""
    b, length = delta.shape
    out = torch.empty_like(delta)
    carry = delta.new_zeros(b)  # A at the first index after the current block
    decay = decay.to(delta.dtype).view(b, 1, 1)
    for start in reversed(range(0, length, GAE_BLOCK)):
        end = min(start + GAE_BLOCK, length)
        idx = torch.arange(end - start, device=delta.device)
        offset = idx.view(1, -1) - idx.view(-1, 1)  # [n, n]: k - j
        powers = decay.pow(offset.clamp_min(0).to(delta.dtype)) * (offset >= 0)  # [B, n, n]
        block = torch.bmm(powers, delta[:, start:end].unsqueeze(-1)).squeeze(-1)
        tail_power = decay.view(b, 1).pow((end - start - idx).to(delta.dtype).view(1, -1))
        block = block + tail_power * carry.view(b, 1)
        out[:, start:end] = block
        carry = block[:, 0]
    return out


def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over action tokens only (SAO.md section 2).

    ``rewards``, ``values`` ``[B, T]``; ``action_mask`` ``[B, T]`` bool; ``lam`` a
    float or ``[B]``. With the action tokens of a row numbered ``j = 1..n`` and
    ``V_{n+1} = 0``: ``delta_j = rho_j + gamma V_{j+1} - V_j`` and
    ``A_j = delta_j + gamma lam A_{j+1}``.

    Credit rule for ``rho``: a reward on an action token belongs to it; a reward on
    a non-action token goes to the last action token before it. A reward placed
    before the first action token (the paper is silent) goes to the first action
    token, so no reward of a row with actions is lost. Values on non-action tokens
    are ignored.

    Returns ``(advantages, returns)``, both ``[B, T]`` float, zero on non-action
    tokens, ``returns = advantages + values`` on action tokens. A row without
    action tokens is all zeros.
    """
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rewards = rewards.detach().to(dtype)
    values = values.detach().to(dtype)
    b, t = action_mask.shape
    device = action_mask.device

    actions_so_far = action_mask.long().cumsum(dim=1)  # [B, T]
    length = max(int(actions_so_far[:, -1].max()) if t else 0, 1)
    slot = (actions_so_far - 1).clamp_min(0)  # packed index of the last action at or before t

    credited = torch.zeros((b, length), dtype=dtype, device=device)
    credited.scatter_add_(1, slot, rewards)

    rows = torch.arange(b, device=device).view(b, 1).expand(b, t)[action_mask]
    packed_index = slot[action_mask]
    packed_values = torch.zeros((b, length), dtype=dtype, device=device)
    packed_values[rows, packed_index] = values[action_mask]

    next_values = torch.cat([packed_values[:, 1:], packed_values.new_zeros(b, 1)], dim=1)
    delta = credited + gamma * next_values - packed_values
    decay = gamma * torch.as_tensor(lam, dtype=dtype, device=device).expand(b)
    packed_adv = _discounted_suffix_sum(delta, decay)

    advantages = torch.zeros((b, t), dtype=dtype, device=device)
    advantages[action_mask] = packed_adv[rows, packed_index]
    returns = torch.where(action_mask, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def whiten(advantages: torch.Tensor, action_mask: torch.Tensor,
           sum_over_ranks: SumOverRanks = local_sum) -> torch.Tensor:
    """Zero-mean, unit-variance advantages over the step's action tokens (optional in SAO).

    ``advantages`` ``[B, T]``, ``action_mask`` ``[B, T]`` bool -> ``[B, T]``, zero on
    non-action tokens. Mean and population std are those of every rank's action tokens:
    this share's count, sum and sum of squares (float64) go through ``sum_over_ranks``
    (collective under FSDP: every rank calls it, even with no action tokens), so the
    result does not depend on how the step was shared out. With fewer than 2 action
    tokens in the whole step the advantages are returned unscaled.
    """
    selected = advantages.detach()[action_mask].to(torch.float64)
    moments = torch.stack([selected.new_tensor(float(selected.numel())), selected.sum(), selected.square().sum()])
    count, total, squares = sum_over_ranks(moments).tolist()
    if count < 2:
        return torch.where(action_mask, advantages, torch.zeros_like(advantages))
    mean = total / count
    # E[x^2] - mean^2 in float64 loses about eps64 * (mean / std)^2 relative; rounding can make it
    # slightly negative when all values are equal, hence the floor at 0
    std = math.sqrt(max(squares / count - mean * mean, 0.0))
    scaled = (advantages - mean) / (std + WHITEN_EPS)
    return torch.where(action_mask, scaled, torch.zeros_like(scaled))
