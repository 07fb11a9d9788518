"""SAO: one learner step on a batch of single rollouts (SAO.md sections 1-3).

1. K critic updates (``cfg.critic_updates``) toward Monte-Carlo returns
   (GAE with ``lambda_critic``; the targets use the critic's values of that update,
   which cancel out when ``lambda_critic = 1``);
2. values from the updated critic, advantages by skip-observation GAE with the
   length-adaptive ``lambda_policy`` of each rollout (optionally whitened);
3. one DIS policy update against the engine's behaviour log-probs.

A step is refused (``skipped_nonfinite = 1``, nothing updated) when the batch holds
a non-finite reward or action-token behaviour log-prob, or when the first
non-finite loss or gradient norm appears. Refusal happens before any optimiser
step of that update; critic updates that already succeeded earlier in the same
step stay (they were finite updates on finite data). Under FSDP each of these
decisions is agreed across ranks through ``vote`` (see :mod:`online_sao.train_step`).

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

import torch

from online_sao.advantages import length_adaptive_lambda, skip_observation_gae, whiten
from online_sao.algorithm import ActorCritic
from online_sao.batch import RolloutBatch
from online_sao.losses import dis_policy_loss, value_loss
from online_sao.train_step import PhaseTimer, batch_metrics, guarded_update, nonfinite_inputs, policy_logprobs


class SAO(ActorCritic):
    """Single-rollout Asynchronous Optimization. Metrics: see :meth:`step`."""

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Metrics: policy_loss, value_loss and explained_variance (critic before this
        step's updates, against its targets), value_loss_after and
        explained_variance_after (updated critic), critic_grad_norm (mean over the K
        updates), policy_grad_norm (before clipping), the DIS metrics, lambda_mean,
        adv_mean, reward_mean, num_rollouts, num_action_tokens, version_lag_mean/max,
        skipped_nonfinite, and time_<phase>_s for the phases critic_forward,
        critic_backward, critic_optimizer, policy_forward, policy_backward,
        policy_optimizer, arithmetic (GAE, lambda, losses, metrics)."""
        cfg, mask, norm = self.cfg, batch.action_mask, batch.token_normalizer
        timer = PhaseTimer()
        metrics = batch_metrics(batch)
        if nonfinite_inputs(batch, self.vote):
            return {**metrics, "skipped_nonfinite": 1.0, "nonfinite_inputs": 1.0}

        critic_norms = []
        for update in range(cfg.critic_updates):
            with timer.phase("critic_forward"):
                values = self.critic(batch.input_ids, batch.attention_mask)
            with timer.phase("arithmetic"):
                _, targets = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, cfg.lambda_critic)
                critic_loss, critic_metrics = value_loss(values, targets, mask, norm)
            if update == 0:
                metrics["value_loss"] = critic_loss.item()
                metrics["explained_variance"] = critic_metrics["explained_variance"]
                metrics["value_mean"] = critic_metrics["value_mean"]
            result = guarded_update(critic_loss, self.critic_optimizer, cfg.max_grad_norm, self.critic_scheduler,
                                    self.vote)
            timer.add("critic_backward", result.backward_s)
            timer.add("critic_optimizer", result.step_s)
            critic_norms.append(result.grad_norm)
            if not result.stepped:
                return {**metrics, **timer.metrics(), "critic_grad_norm": result.grad_norm,
                        "skipped_nonfinite": 1.0, "critic_updates_done": float(update)}
        metrics["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
        metrics["critic_lr"] = float(self.critic_optimizer.param_groups[0]["lr"])

        with torch.no_grad(), timer.phase("critic_forward"):
            values = self.critic(batch.input_ids, batch.attention_mask)
        with timer.phase("arithmetic"):
            lam = length_adaptive_lambda(mask.sum(dim=1), cfg.lambda_alpha)
            advantages, _ = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, lam)
            loss_after, after = value_loss(values, targets, mask, norm)
            metrics["value_loss_after"] = float(loss_after)
            metrics["explained_variance_after"] = after["explained_variance"]
            if cfg.normalize_advantages:
                advantages = whiten(advantages, mask)
            metrics["lambda_mean"] = float(lam.mean())
            metrics["adv_mean"] = float(advantages[mask].mean()) if bool(mask.any()) else 0.0

        with timer.phase("policy_forward"):
            logprobs = policy_logprobs(self.policy, batch)
        with timer.phase("arithmetic"):
            policy_loss, dis_metrics = dis_policy_loss(
                logprobs, batch.rollout_logprobs, advantages, mask, cfg.eps_low, cfg.eps_high, norm)
        result = guarded_update(policy_loss, self.policy_optimizer, cfg.max_grad_norm, vote=self.vote)
        timer.add("policy_backward", result.backward_s)
        timer.add("policy_optimizer", result.step_s)
        return {
            **metrics,
            **dis_metrics,
            **timer.metrics(),
            "policy_loss": policy_loss.item(),
            "policy_grad_norm": result.grad_norm,
            "skipped_nonfinite": 0.0 if result.stepped else 1.0,
        }
