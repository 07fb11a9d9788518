"""Baselines measured against SAO in the same harness (SAO.md section 4).

- :class:`RunningMean`: advantage = rollout reward - mean of the last W rewards, DIS, no critic.
- :class:`GRPO`: group-normalised advantages, PPO clip against pi_old, DIS optional.
- :class:`PPO`: critic + GAE with a fixed lambda + PPO clip against pi_old, no DIS.

A rollout's reward here is the sum of the rewards placed on its tokens. Like SAO, each
adds the KL / entropy terms of its :class:`~online_sao.regularizers.PolicyRegularizer`
(none unless configured) to every policy loss, skips a policy update whose loss has no
gradient on any rank (no token inside the DIS band, or no action token, with no regularizer on;
or a gradient of exactly zero, every advantage 0:
``policy_update_skipped_empty = 1``, the step not refused; :func:`online_sao.train_step.guarded_update`; ppo's
critic update likewise on a step without action tokens), and
refuses a batch with non-finite inputs, losses or gradient norms
(``skipped_nonfinite = 1``) before any optimiser step of the failing update, each
check agreed across ranks through the ``vote`` they are given (see
:mod:`online_sao.train_step`).
pi_old is the policy at the start of the step: the log-probs of the first
update's forward pass, detached (a separate no-grad forward gives the same numbers).

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from online_sao.advantages import skip_observation_gae, whiten
from online_sao.algorithm import ActorCritic, PolicyOnly
from online_sao.batch import RolloutBatch
from online_sao.config import AlgorithmConfig
from online_sao.losses import clipped_surrogate_loss, dis_policy_loss, explained_variance, masked_mean, value_loss
from online_sao.modeling import packing_verdict
from online_sao.regularizers import PolicyRegularizer
from online_sao.train_step import (FiniteVote, batch_metrics, guarded_update, local_vote, nonfinite_inputs,
                                   policy_forward, policy_packs, policy_signal_tokens)

GROUP_STD_EPS = 1e-6
"""Added to a group's reward standard deviation: a group of equal rewards has
numerator 0 and std 0, and the epsilon turns 0/0 into advantage 0."""

REFUSED = {"skipped_nonfinite": 1.0}


def _token_advantages(row_advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, T]``: each row's advantage on every one of its action tokens."""
    return row_advantages.view(-1, 1) * action_mask


def group_normalized_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO advantages ``(r - mean_group) / (std_group + GROUP_STD_EPS)``.

    ``rewards``, ``group_ids`` ``[B]`` -> ``[B]``. std is the sample standard
    deviation (n - 1), as common GRPO implementations use. A group with a single
    rollout carries no comparison and gets advantage 0.
    Metrics: num_groups, singleton_groups, degenerate_group_frac (groups whose
    rewards are all equal and so teach nothing).
    """
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    num = groups.numel()
    r = rewards.float()
    zeros = torch.zeros(num, device=r.device)
    count = zeros.index_add(0, inverse, torch.ones_like(r))
    mean = zeros.index_add(0, inverse, r) / count
    centred = r - mean[inverse]
    sq = zeros.index_add(0, inverse, centred.pow(2))
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    advantages = torch.where(count[inverse] > 1, centred / (std[inverse] + GROUP_STD_EPS), torch.zeros_like(r))
    multi = count > 1
    metrics = {
        "num_groups": float(num),
        "singleton_groups": float((~multi).sum()),
        "degenerate_group_frac": float(((std == 0) & multi).sum()) / max(int(multi.sum()), 1),
    }
    return advantages, metrics


class RunningMean(PolicyOnly):
    """A = reward - mean of the last W rewards seen before this step; DIS; no critic.

    The baseline excludes the step's own rewards so a rollout never baselines
    against itself. The first step, with no history, uses its own mean. The
    window advances only on steps that were not refused (a step whose policy update was
    skipped for want of a kept token still saw its rewards). Under several ranks the
    window and the first step's mean follow the whole step
    (``batch.step_rewards``), not the rank's share, so every rank keeps the one
    window a single process would.
    """

    def __init__(self, policy: nn.Module, policy_optimizer: torch.optim.Optimizer, cfg: AlgorithmConfig,
                 vote: FiniteVote = local_vote, regularizer: PolicyRegularizer | None = None) -> None:
        super().__init__(policy, policy_optimizer, cfg, vote, regularizer)
        self.window: deque[float] = deque(maxlen=cfg.running_mean_window)

    def baseline(self, step_rewards: list[float]) -> float:
        """Mean of the window; before any history, of the step's own rewards."""
        history = self.window or step_rewards
        return sum(history) / len(history)

    def row_advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, float]:
        """``[B]`` advantage of each rollout (reward - baseline) and the baseline."""
        whole_step = batch.step_rewards if batch.step_rewards is not None else batch.rewards.sum(dim=1).tolist()
        baseline = self.baseline(whole_step)
        return batch.rewards.sum(dim=1) - baseline, baseline

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        cfg, mask = self.cfg, batch.action_mask
        metrics = batch_metrics(batch, policy_packs(self.policy))
        if nonfinite_inputs(batch, self.vote):
            return {**metrics, **REFUSED, "nonfinite_inputs": 1.0}
        rewards = batch.rewards.sum(dim=1)
        row_adv, baseline = self.row_advantages(batch)
        advantages = _token_advantages(row_adv, mask)
        logprobs, entropy = policy_forward(self.policy, batch, with_entropy=self.regularizer.needs_entropy)
        loss, dis_metrics = dis_policy_loss(
            logprobs, batch.rollout_logprobs, advantages, mask, cfg.eps_low, cfg.eps_high, batch.token_normalizer)
        extra, extra_metrics = self.regularizer.loss(batch, logprobs, entropy)
        loss = loss + extra
        result = guarded_update(loss, self.policy_optimizer, cfg.max_grad_norm, vote=self.vote,
                                signal_tokens=policy_signal_tokens(logprobs, batch, cfg, dis=True))
        if not result.refused:
            self.window.extend(batch.step_rewards if batch.step_rewards is not None else rewards.tolist())
        if result.stepped:
            self.regularizer.after_policy_update(self.policy)
        return {**metrics, **dis_metrics, **extra_metrics, "policy_loss": loss.item(),
                "policy_grad_norm": result.grad_norm,
                "baseline": baseline, "adv_mean": masked_mean(advantages, mask),  # per action token, as SAO's
                "skipped_nonfinite": 1.0 if result.refused else 0.0,
                "policy_update_skipped_empty": 1.0 if result.empty else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"reward_window": list(self.window)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state`` of another rule (a checkpoint trained by sao, say) has no window: the baseline
        starts from the next step's rewards, as on a first start (a bare KeyError at every restart)."""
        self.window = deque(state.get("reward_window", ()), maxlen=self.cfg.running_mean_window)

    def forget(self) -> None:
        """The baseline restarts from the next step's own rewards."""
        self.window.clear()


def _clipped_updates(
    policy: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, advantages: torch.Tensor,
    cfg: AlgorithmConfig, use_dis: bool, vote: FiniteVote, regularizer: PolicyRegularizer, after_update=None,
) -> dict[str, float]:
    """``cfg.ppo_epochs`` clipped-surrogate updates (plus ``regularizer``'s terms) against the
    step-start pi_old. ``after_update`` (optional) runs after each policy update not refused and
    returns False to refuse the rest of the step (it must decide the same on every rank).

    A refusal before any policy update refuses the step (``skipped_nonfinite``: no weight moved).
    One after an applied update ends the step there: the policy has moved, so the step counts as
    trained (published, its rollouts trained) and says ``refused_after_update = 1``. An update
    whose loss has no gradient on any rank (no token inside the DIS band with ``use_dis``, no
    action token without, a gradient of exactly zero: every advantage 0, every token clipped) makes no optimiser step and is not a refusal: ``after_update`` still
    runs (ppo's critic trains as in any epoch), and a step none of whose updates was applied for
    that reason says ``policy_update_skipped_empty = 1`` (the policy as it was)."""
    old_logprobs = None
    metrics: dict[str, float] = {}
    applied, skipped_empty = 0, False
    for _ in range(cfg.ppo_epochs):
        logprobs, entropy = policy_forward(policy, batch, with_entropy=regularizer.needs_entropy)
        if old_logprobs is None:
            old_logprobs = logprobs.detach()
        loss, loss_metrics = clipped_surrogate_loss(
            logprobs, old_logprobs, advantages, batch.action_mask, cfg.clip_low, cfg.clip_high,
            rollout_logprobs=batch.rollout_logprobs if use_dis else None,
            eps_low=cfg.eps_low, eps_high=cfg.eps_high, normalizer=batch.token_normalizer)
        extra, extra_metrics = regularizer.loss(batch, logprobs, entropy)
        loss = loss + extra
        result = guarded_update(loss, optimizer, cfg.max_grad_norm, vote=vote,
                                signal_tokens=policy_signal_tokens(logprobs, batch, cfg, dis=use_dis))
        if result.stepped:
            regularizer.after_policy_update(policy)
            applied += 1
        skipped_empty = skipped_empty or result.empty
        metrics.update(loss_metrics, **extra_metrics, policy_loss=loss.item(), policy_grad_norm=result.grad_norm,
                       policy_updates_done=float(applied),
                       policy_update_skipped_empty=float(skipped_empty and applied == 0))
        if result.refused or (after_update is not None and not after_update(metrics)):
            if applied == 0:
                return {**metrics, **REFUSED}
            return {**metrics, "skipped_nonfinite": 0.0, "refused_after_update": 1.0}
    return {**metrics, "skipped_nonfinite": 0.0, "refused_after_update": 0.0}


class GRPO(PolicyOnly):
    """Group-normalised advantages, PPO clip (clip_low/clip_high) against pi_old,
    the DIS mask against the engine's log-probs when ``cfg.use_dis``; no critic.

    Rows are grouped by ``batch.group_ids``; an ungrouped row (id < 0) is an error.
    Under several ranks each group lies whole on one rank
    (:func:`trainer.distributed.shard_rollouts`), so its statistics are the
    single process's.
    """

    def __init__(self, policy: nn.Module, policy_optimizer: torch.optim.Optimizer, cfg: AlgorithmConfig,
                 vote: FiniteVote = local_vote, regularizer: PolicyRegularizer | None = None) -> None:
        super().__init__(policy, policy_optimizer, cfg, vote, regularizer)
        self.group_size = cfg.group_size

    def row_advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B]`` group-normalised advantage of each rollout, and the group metrics."""
        return group_normalized_advantages(batch.rewards.sum(dim=1), batch.group_ids)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        metrics = batch_metrics(batch, policy_packs(self.policy))
        if bool((batch.group_ids < 0).any()):
            raise ValueError("grpo needs grouped rollouts: every group_id must be >= 0")
        if nonfinite_inputs(batch, self.vote):
            return {**metrics, **REFUSED, "nonfinite_inputs": 1.0}
        row_adv, group_metrics = self.row_advantages(batch)
        advantages = _token_advantages(row_adv, batch.action_mask)
        update_metrics = _clipped_updates(self.policy, self.policy_optimizer, batch, advantages, self.cfg,
                                          use_dis=self.cfg.use_dis, vote=self.vote, regularizer=self.regularizer)
        return {**metrics, **group_metrics, **update_metrics}


class PPO(ActorCritic):
    """Critic + GAE with ``cfg.ppo_lambda`` + PPO clip against pi_old, no DIS.

    GAE skips observation tokens like SAO's (identical to token-level GAE for a
    single action segment). Advantages and value targets come from the critic at
    the step's start; each of the ``cfg.ppo_epochs`` epochs makes one policy and one
    critic update.
    """

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        cfg, mask = self.cfg, batch.action_mask
        metrics = batch_metrics(batch, policy_packs(self.policy), packing_verdict(self.critic))
        if nonfinite_inputs(batch, self.vote):
            return {**metrics, **REFUSED, "nonfinite_inputs": 1.0}
        with torch.no_grad():
            values = self.critic(batch.input_ids, batch.attention_mask)
        advantages, returns = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, cfg.ppo_lambda)
        metrics["explained_variance"] = explained_variance(values, returns, mask)
        if cfg.normalize_advantages:
            advantages = whiten(advantages, mask, self.sum_over_ranks)
        metrics["adv_mean"] = float(advantages[mask].mean()) if bool(mask.any()) else 0.0  # after whitening, as SAO's

        def critic_update(step_metrics: dict[str, float]) -> bool:
            critic_loss, _ = value_loss(self.critic(batch.input_ids, batch.attention_mask), returns, mask,
                                        batch.token_normalizer)
            # the value loss covers the action tokens: without one (on every rank) no step, as for the policy
            result = guarded_update(critic_loss, self.critic_optimizer, cfg.max_grad_norm, self.critic_scheduler,
                                    self.vote, signal_tokens=int(mask.sum()))
            step_metrics.setdefault("value_loss", critic_loss.item())
            step_metrics["critic_grad_norm"] = result.grad_norm
            return not result.refused

        update_metrics = _clipped_updates(self.policy, self.policy_optimizer, batch, advantages, cfg,
                                          use_dis=False, vote=self.vote, regularizer=self.regularizer,
                                          after_update=critic_update)
        return {**metrics, **update_metrics}
