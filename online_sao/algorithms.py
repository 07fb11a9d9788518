"""Build the learning rule and its optimisers from :class:`~online_sao.config.AlgorithmConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from online_sao.algorithm import Algorithm
from online_sao.baselines import GRPO, PPO, RunningMean
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.sao import SAO
from online_sao.train_step import FiniteVote, local_vote


@dataclass
class Optimizers:
    """AdamW of the policy, and of the critic with its warm-up schedule (None without a critic)."""

    policy: torch.optim.Optimizer
    critic: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning rate ramps linearly over ``warmup_steps`` updates, then stays at its base.

    The first update already uses ``1 / warmup_steps`` of the rate (not 0, which
    would waste it)."""
    def factor(done: int) -> float:
        return 1.0 if warmup_steps == 0 else min(1.0, (done + 1) / warmup_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


RULES_WITH_CRITIC = ("sao", "ppo")
"""Rules that train a value model (their classes set ``needs_critic``)."""


def build_critic(cfg: AlgorithmConfig, policy: nn.Module) -> ValueModel | None:
    """A critic copied from ``policy`` when rule ``cfg.name`` uses one, else None."""
    if cfg.name not in RULES_WITH_CRITIC:
        return None
    return ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention)


def build_optimizers(cfg: AlgorithmConfig, policy: nn.Module, critic: nn.Module | None) -> Optimizers:
    """AdamW over the trainable parameters of each model (a frozen-attention
    critic's attention is left out), with ``cfg.policy_lr`` / ``cfg.critic_lr``."""
    def adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)

    policy_optimizer = adamw(policy, cfg.policy_lr)
    if critic is None:
        return Optimizers(policy=policy_optimizer)
    critic_optimizer = adamw(critic, cfg.critic_lr)
    return Optimizers(policy_optimizer, critic_optimizer, linear_warmup(critic_optimizer, cfg.critic_warmup_steps))


def build_algorithm(
    cfg: AlgorithmConfig,
    policy: nn.Module,
    critic: ValueModel | None,
    policy_optimizer: torch.optim.Optimizer,
    critic_optimizer: torch.optim.Optimizer | None,
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    vote: FiniteVote = local_vote,
) -> Algorithm:
    """The rule ``cfg.name`` names. Rules with ``needs_critic`` require a critic and its optimiser.
    ``vote`` agrees on the rule's finiteness checks across ranks (the learner passes
    :func:`trainer.distributed.finite_vote`; one process keeps its own result)."""
    if cfg.name in RULES_WITH_CRITIC and (critic is None or critic_optimizer is None):
        raise ValueError(f"algorithm {cfg.name!r} needs a critic and a critic optimizer")
    if cfg.name == "sao":
        return SAO(policy, critic, policy_optimizer, critic_optimizer, cfg, critic_scheduler, vote)
    if cfg.name == "ppo":
        return PPO(policy, critic, policy_optimizer, critic_optimizer, cfg, critic_scheduler, vote)
    if cfg.name == "running_mean":
        return RunningMean(policy, policy_optimizer, cfg, vote)
    if cfg.name == "grpo":
        return GRPO(policy, policy_optimizer, cfg, vote)
    raise ValueError(f"unknown algorithm {cfg.name!r}")
