"""The seam between the learner loop and a learning rule.

The learner (trainer/) builds policy, critic and optimisers, collates joined
rollouts into a :class:`~online_sao.batch.RolloutBatch` and calls
:meth:`Algorithm.step`. SAO and the baselines (SAO.md section 4) implement it,
each from one of two bases: :class:`ActorCritic` (a critic and its optimiser) or
:class:`PolicyOnly` (the policy alone). :data:`online_sao.algorithms.ALGORITHMS`
maps configuration names to the classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from online_sao.advantages import SumOverRanks, local_sum
from online_sao.batch import RolloutBatch
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.regularizers import PolicyRegularizer
from online_sao.train_step import FiniteVote, local_vote


class Algorithm(ABC):
    """One learning rule. ``step`` updates the models in place and returns float metrics.

    A step whose loss or gradients are not finite must not apply the failing update nor any
    after it, and must report ``skipped_nonfinite = 1.0`` in its metrics; updates that finished
    earlier in the step stay (SAO's critic updates, docs/ALGORITHM.md section 8).
    """

    needs_critic: ClassVar[bool]
    """Whether the learner must build a critic for this rule (set by the two bases below)."""
    group_size: int = 1
    """Rollouts per prompt the rule needs together (grpo: G; everything else: 1)."""

    @abstractmethod
    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on one batch; metrics are plain floats."""

    def state_dict(self) -> dict[str, Any]:
        """Extra state to checkpoint besides models and optimisers (e.g. a reward window)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def forget(self) -> None:
        """Drop statistics of rewards gathered before a detected preference change
        (trainer/plasticity.py); rules that keep none have nothing to drop."""


class PolicyOnly(Algorithm):
    """A rule that trains the policy alone (no critic)."""

    needs_critic = False

    def __init__(self, policy: nn.Module, policy_optimizer: torch.optim.Optimizer, cfg: AlgorithmConfig,
                 vote: FiniteVote = local_vote, regularizer: PolicyRegularizer | None = None) -> None:
        """``vote`` agrees on each finiteness check across ranks (the identity in one process);
        ``regularizer`` adds the KL / entropy terms to every policy loss (None: one from ``cfg``,
        which then must not ask for the KL penalty: it has no reference policy)."""
        self.policy = policy
        self.policy_optimizer = policy_optimizer
        self.cfg = cfg
        self.vote = vote
        self.regularizer = regularizer or PolicyRegularizer(cfg)


class ActorCritic(Algorithm):
    """A rule that trains a policy and a critic (value model) together."""

    needs_critic = True

    def __init__(
        self,
        policy: nn.Module,
        critic: ValueModel,
        policy_optimizer: torch.optim.Optimizer,
        critic_optimizer: torch.optim.Optimizer,
        cfg: AlgorithmConfig,
        critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        vote: FiniteVote = local_vote,
        regularizer: PolicyRegularizer | None = None,
        sum_over_ranks: SumOverRanks = local_sum,
    ) -> None:
        """``vote`` and ``regularizer``: as in :class:`PolicyOnly`. ``sum_over_ranks`` gives
        whitening the whole step's moments across ranks (the identity in one process)."""
        self.vote = vote
        self.sum_over_ranks = sum_over_ranks
        self.policy = policy
        self.critic = critic
        self.policy_optimizer = policy_optimizer
        self.critic_optimizer = critic_optimizer
        self.critic_scheduler = critic_scheduler
        self.cfg = cfg
        self.regularizer = regularizer or PolicyRegularizer(cfg)
