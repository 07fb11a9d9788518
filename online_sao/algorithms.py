"""The registry of learning rules, and building a rule, its critic and its optimisers from
:class:`~online_sao.config.AlgorithmConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from online_sao.advantages import SumOverRanks, local_sum
from online_sao.algorithm import Algorithm
from online_sao.baselines import GRPO, PPO, RunningMean
from online_sao.config import AlgorithmConfig, ConfigError
from online_sao.critic import FreezeError, ValueModel
from online_sao.regularizers import PolicyRegularizer
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


ALGORITHMS: dict[str, type[Algorithm]] = {"sao": SAO, "running_mean": RunningMean, "grpo": GRPO, "ppo": PPO}
"""The learning rules by the name ``algorithm.name`` gives them; each class says whether it
needs a critic (``needs_critic``)."""


def algorithm_class(name: str) -> type[Algorithm]:
    """The class of rule ``name``; ValueError for a name the registry does not hold."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}")
    return ALGORITHMS[name]


FREEZE_KEYS = {"freeze_attention": "algorithm.freeze_critic_attention",
               "trainable_layers": "algorithm.critic_trainable_layers"}
"""The config key behind each argument of :class:`~online_sao.critic.ValueModel` a
:class:`~online_sao.critic.FreezeError` names."""


def build_critic(cfg: AlgorithmConfig, policy: nn.Module) -> ValueModel | None:
    """A critic copied from ``policy`` when rule ``cfg.name`` uses one, else None. A freeze the
    policy's architecture cannot take is a :class:`~online_sao.config.ConfigError` naming the key
    and the model type."""
    if not algorithm_class(cfg.name).needs_critic:
        return None
    try:
        return ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention,
                                      trainable_layers=cfg.critic_trainable_layers)
    except FreezeError as exc:
        model_type = getattr(policy.config, "model_type", None) or type(policy).__name__
        raise ConfigError(f"{FREEZE_KEYS[exc.argument]}: not possible for model type {model_type!r}: {exc}") from exc


ADAMW_KERNEL_ARGUMENTS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}
"""``torch.optim.AdamW``'s arguments for each ``AlgorithmConfig.optimizer_kernel``."""


def build_optimizers(cfg: AlgorithmConfig, policy: nn.Module, critic: nn.Module | None) -> Optimizers:
    """AdamW over the trainable parameters of each model (a frozen-attention
    critic's attention is left out), with ``cfg.policy_lr`` / ``cfg.critic_lr``."""
    def adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay,
                                 **ADAMW_KERNEL_ARGUMENTS[cfg.optimizer_kernel])

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
    reference: nn.Module | None = None,
    sum_over_ranks: SumOverRanks = local_sum,
) -> Algorithm:
    """The rule ``cfg.name`` names. Rules with ``needs_critic`` require a critic and its optimiser.
    ``vote`` agrees on the rule's finiteness checks across ranks (the learner passes
    :func:`trainer.distributed.finite_vote`; one process keeps its own result). ``reference``
    is the KL penalty's reference policy (:func:`online_sao.regularizers.build_reference`),
    required when ``cfg.kl_beta > 0``. ``sum_over_ranks`` sums whitening's moments over ranks
    for the rules with a critic (the learner passes :func:`trainer.distributed.rank_sum`; the
    policy-only rules do not whiten)."""
    rule = algorithm_class(cfg.name)
    regularizer = PolicyRegularizer(cfg, reference)
    if not rule.needs_critic:
        return rule(policy, policy_optimizer, cfg, vote, regularizer)
    if critic is None or critic_optimizer is None:
        raise ValueError(f"algorithm {cfg.name!r} needs a critic and a critic optimizer")
    return rule(policy, critic, policy_optimizer, critic_optimizer, cfg, critic_scheduler, vote, regularizer,
                sum_over_ranks)
