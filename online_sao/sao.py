"""SAO: one learner step on a batch of single rollouts (SAO.md sections 1-3b).

1. K critic updates (``cfg.critic_updates``) toward Monte-Carlo returns (GAE with
   ``lambda_critic``; the targets use the critic's values of that update, which cancel out
   when ``lambda_critic = 1``), placed by ``cfg.critic_order`` (:mod:`online_sao.critic_order`):
   on the step's rollouts before its values are taken (``fit_then_judge``), after
   (``judge_then_fit``), or on a window of earlier rollouts instead (``replay_then_judge``);
2. advantages by skip-observation GAE from the values the order gives (shrunk toward a running
   mean of rewards when ``cfg.value_shrinkage_window`` is set, levelled at it with
   ``cfg.value_level_window``, :mod:`online_sao.value_shrinkage`), with the
   length-adaptive ``lambda_policy`` of each rollout (optionally whitened);
3. one DIS policy update against the engine's behaviour log-probs, plus the KL and entropy
   terms of :class:`~online_sao.regularizers.PolicyRegularizer` when configured.

With ``cfg.critic_rewarm_rollouts``, for that many rollouts after :meth:`SAO.forget` (a drift
restart, which also resets the critic) the K updates fit every rollout since the restart and
the advantages take their mean reward as a constant baseline instead of the critic's values.

A step none of whose action tokens is inside the DIS band (on any rank), with no regularizer on,
gives the policy no gradient, as does one whose policy gradient is exactly zero for another
reason (every advantage 0, greedy tokens): its policy update is skipped
(``policy_update_skipped_empty = 1``, no optimiser step, the policy bit-for-bit as it was); the
critic trains on the step as usual and the step is not refused. A batch the K updates fit with no
action token (on any rank), or with a value-loss gradient of exactly zero, gives the critic no
gradient either: those updates make no optimiser step and no warm-up step
(``critic_updates_done = 0``, the critic bit-for-bit as it was), and the step is not refused.

A step is refused (``skipped_nonfinite = 1``, the policy not updated) when the batch holds
a non-finite reward or action-token behaviour log-prob, or when the first
non-finite loss or gradient norm appears. Refusal happens before any optimiser
step of that update; critic updates that already succeeded earlier in the same
step stay (they were finite updates on finite data): the K updates run before the
policy update, so a step refused there has trained the critic (``critic_updates_done``).
Under FSDP each of these decisions is agreed across ranks through ``vote`` (see
:mod:`online_sao.train_step`).

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from online_sao.advantages import length_adaptive_lambda, skip_observation_gae, whiten
from online_sao.algorithm import ActorCritic
from online_sao.batch import RolloutBatch
from online_sao.critic_order import CriticPass, FitOutcome, ReplayWindow, order_critic_updates
from online_sao.losses import MIN_NORMALIZER, dis_policy_loss, endpoint_squared_errors, value_loss
from online_sao.modeling import packing_verdict
from online_sao.train_step import (PhaseTimer, batch_metrics, guarded_update, nonfinite_inputs, policy_forward,
                                   policy_packs, policy_signal_tokens)
from online_sao.value_shrinkage import ShrinkageWindow, anchor_level, rollout_sums, shrink


def _suffixed(metrics: dict[str, float], suffix: str) -> dict[str, float]:
    """:meth:`SAO._fit_metrics` under names ending in ``suffix``; ``value_mean`` only for the
    critic's own values (no suffix)."""
    return {f"{name}{suffix}": value for name, value in metrics.items() if suffix == "" or name != "value_mean"}


def _joined(window: ReplayWindow, batch: RolloutBatch) -> RolloutBatch:
    """``window``'s rollouts and then every one of ``batch``'s, as one batch, leaving ``window`` as
    it was: the fit that needs them may yet be refused. Past the window's capacity too: the re-warm's
    fit takes every rollout since the restart, and the window is cleared once they reach it."""
    joined = ReplayWindow(len(window) + batch.batch_size)
    joined.rows.extend(window.rows)
    joined.add(batch)
    return joined.batch()


class SAO(ActorCritic):
    """Single-rollout Asynchronous Optimization. Metrics: see :meth:`step`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The arguments of :class:`~online_sao.algorithm.ActorCritic`."""
        super().__init__(*args, **kwargs)
        self.window = ReplayWindow(self.cfg.critic_replay_rollouts)
        window = self.cfg.value_shrinkage_window or self.cfg.value_level_window  # at most one is set
        self.shrinkage = ShrinkageWindow(window, self.sum_over_ranks) if window else None
        rewarm = self.cfg.critic_rewarm_rollouts
        self.rewarm_window = ReplayWindow(rewarm) if rewarm else None
        self.rewarm_left = 0
        """Rollouts (over all ranks) left in the critic's re-warm after a restart (0: none)."""
        self.phase_sync: Callable[[], None] | None = None
        """When set, each step's phase timer calls it around every phase (``PhaseTimer.synchronize``):
        a benchmark on a GPU sets ``torch.cuda.synchronize`` to split a step's device time by phase."""

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Metrics: policy_loss (DIS plus any regularizer terms), value_loss,
        explained_variance and value_mean (critic before any update of this step, on this
        batch: out-of-sample whatever the order), value_loss_first and value_loss_last (its
        squared error at each rollout's first and last action token, this rank's rollouts), value_loss_used and
        explained_variance_used (the values the advantages use), value_loss_after and
        explained_variance_after (critic after this step's updates; under ``judge_then_fit`` only
        with ``critic_after_metrics``), critic_fit_loss (first
        update's loss on the data it fit), critic_grad_norm (mean over the K updates),
        critic_updates_done, critic_lr, replay_window (rollouts in it), shrinkage_alpha,
        shrinkage_mean and shrinkage_rollouts (with ``value_shrinkage_window``), level_mean and
        level_rollouts (with ``value_level_window``), value_loss_adjusted and
        explained_variance_adjusted (the values the advantages take, after either), critic_rewarm,
        rewarm_level and rewarm_left (on a re-warm step, ``critic_rewarm_rollouts``), policy_grad_norm
        (before clipping), the DIS metrics, the regularizer's metrics, lambda_mean, adv_mean,
        reward_mean, num_rollouts, num_action_tokens, version_lag_mean/max,
        skipped_nonfinite, policy_update_skipped_empty (on a step that reaches the policy update:
        1 when the policy loss had no gradient, the policy not updated), and time_<phase>_s for the
        phases critic_forward, critic_backward, critic_optimizer, policy_forward, policy_backward,
        policy_optimizer, arithmetic (GAE, lambda, losses, metrics)."""
        timer = PhaseTimer(synchronize=self.phase_sync)
        metrics = batch_metrics(batch, policy_packs(self.policy), packing_verdict(self.critic))
        if nonfinite_inputs(batch, self.vote):
            return {**metrics, "skipped_nonfinite": 1.0, "nonfinite_inputs": 1.0}
        if self.rewarm_left > 0:
            rewarm = self._rewarm(batch, timer, metrics)  # adds the advantages' metrics to ``metrics``
            return {**metrics, **rewarm, **timer.metrics()}
        window = self.window.batch() if self.cfg.critic_order == "replay_then_judge" else None
        if window is not None:  # every rank's window is empty or not alike: they fill on the same steps
            window.token_normalizer = self._spread_normalizer(window)
        judged = order_critic_updates(self.cfg.critic_order, batch, lambda b: self._fit(b, timer),
                                      lambda b: self._values(b, timer), window, self.cfg.critic_after_metrics)
        with timer.phase("arithmetic"):
            metrics.update(self._critic_metrics(batch, judged))
        if judged.used is None:
            return {**metrics, **timer.metrics(), "skipped_nonfinite": 1.0}
        with timer.phase("arithmetic"):
            used = self._shrunk(batch, judged.used, metrics)
            if self.shrinkage is not None:  # the values the advantages take, beside the critic's own
                metrics.update(_suffixed(self._fit_metrics(batch, used), "_adjusted"))
            advantages = self._advantages(batch, used, metrics)
        update = self._policy_update(batch, advantages, timer)
        if not update["skipped_nonfinite"]:
            self._after_policy_update(update)
            if self.cfg.critic_order == "replay_then_judge":
                self.window.add(batch)
            if self.shrinkage is not None:
                _, targets = skip_observation_gae(batch.rewards, judged.before, batch.action_mask, self.cfg.gamma,
                                                  self.cfg.lambda_critic)
                self.shrinkage.add(rollout_sums(judged.before, targets, batch.rewards, batch.action_mask))
        return {**metrics, **update, **timer.metrics(), "replay_window": float(len(self.window))}

    def _shrunk(self, batch: RolloutBatch, values: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """``values`` shrunk toward the running mean (``value_shrinkage_window``), levelled at it
        (``value_level_window``), or as they are."""
        if self.shrinkage is None:
            return values
        estimate = self.shrinkage.estimate(batch.rewards)
        if self.cfg.value_level_window:
            metrics.update({"level_mean": estimate.mean, "level_rollouts": float(estimate.rollouts)})
            return anchor_level(values, batch.action_mask, estimate.mean)
        metrics.update({"shrinkage_alpha": estimate.alpha, "shrinkage_mean": estimate.mean,
                        "shrinkage_rollouts": float(estimate.rollouts)})
        return shrink(values, estimate.mean, estimate.alpha)

    def _rewarm(self, batch: RolloutBatch, timer: PhaseTimer, metrics: dict[str, float]) -> dict[str, float]:
        """A step while the critic re-warms after a restart (``critic_rewarm_rollouts``): the K critic
        updates fit the rollouts since the restart and the step's, which join them once that fit is
        applied (a refused step's stay out); the policy's advantages take, instead of the cold
        critic's values, the constant mean reward of the rollouts since the restart before this
        step (the step's own mean for the first)."""
        window = self.rewarm_window
        earlier = window.batch() or batch
        joined = _joined(window, batch)
        # one collective: the earlier rollouts' reward sum and count, this step's rollout count, and
        # the fit's action tokens and ranks (its normaliser: _spread_normalizer)
        reward_sum, count, taken, tokens, ranks = self.sum_over_ranks(torch.tensor(
            [float(earlier.rewards.sum()), float(earlier.batch_size), float(batch.batch_size),
             float(joined.action_mask.sum()), 1.0], dtype=torch.float64)).tolist()
        level = reward_sum / count
        joined.token_normalizer = max(tokens, MIN_NORMALIZER) / ranks
        fit = self._fit(joined, timer)
        if not fit.stepped:  # a refused step's rollouts stay out of later fits and levels, as in a normal step
            return {**fit.metrics, "skipped_nonfinite": 1.0}
        with timer.phase("arithmetic"):
            advantages = self._advantages(batch, torch.full_like(batch.rewards, level), metrics)
        update = self._policy_update(batch, advantages, timer)
        if not update["skipped_nonfinite"]:  # refused at the policy update: refused too (not trained, not counted)
            self._after_policy_update(update)  # as after a normal step's policy update
            window.add(batch)
            self.rewarm_left = max(0, self.rewarm_left - round(taken))
            if self.rewarm_left == 0:
                window.clear()
        return {**fit.metrics, **update, "critic_updates_done": float(fit.updates_done), "critic_rewarm": 1.0,
                "rewarm_level": level, "rewarm_left": float(self.rewarm_left)}

    def _spread_normalizer(self, window: RolloutBatch) -> float:
        """The normaliser of a fit on ``window``, this rank's share of a fit on every rank's:
        ``N_global / world_size``, as the step's own batch has (trainer/distributed.py; FSDP averages
        the ranks' gradients, so each rank's own token mean weighed a rank's short window as much as
        another's long one). Its own action-token count in one process. One collective."""
        tokens, ranks = self.sum_over_ranks(torch.tensor([float(window.action_mask.sum()), 1.0],
                                                         dtype=torch.float64)).tolist()
        return max(tokens, MIN_NORMALIZER) / ranks

    def _values(self, batch: RolloutBatch, timer: PhaseTimer) -> torch.Tensor:
        with torch.no_grad(), timer.phase("critic_forward"):
            return self.critic(batch.input_ids, batch.attention_mask)

    def _fit(self, batch: RolloutBatch, timer: PhaseTimer) -> FitOutcome:
        """``cfg.critic_updates`` guarded value-loss updates toward ``batch``'s targets."""
        cfg, norms, rates, first_loss, first_values = self.cfg, [], [], math.nan, None
        for update in range(cfg.critic_updates):
            with timer.phase("critic_forward"):
                values = self.critic(batch.input_ids, batch.attention_mask)
            if update == 0:  # the critic as it stands: the batch's values before the step
                first_values = values.detach()
            with timer.phase("arithmetic"):
                _, targets = skip_observation_gae(batch.rewards, values, batch.action_mask, cfg.gamma,
                                                  cfg.lambda_critic)
                loss, _ = value_loss(values, targets, batch.action_mask, batch.token_normalizer)
            first_loss = loss.item() if update == 0 else first_loss
            rate = self._critic_rate()  # read before the update: an applied one steps the warm-up past it
            # the value loss covers the action tokens: without one (on every rank) it has no gradient,
            # and AdamW would move the critic by its momentum alone
            result = guarded_update(loss, self.critic_optimizer, cfg.max_grad_norm, self.critic_scheduler, self.vote,
                                    signal_tokens=int(batch.action_mask.sum()))
            timer.add("critic_backward", result.backward_s)
            timer.add("critic_optimizer", result.step_s)
            norms.append(result.grad_norm)
            if result.stepped:
                rates.append(rate)
            if result.refused:
                return FitOutcome(False, update, {"critic_grad_norm": result.grad_norm, "critic_fit_loss": first_loss,
                                                  "critic_lr": self._mean_rate(rates)}, first_values)
            if result.empty:  # so is every later one (same batch, same critic): the fit stands, nothing applied
                return FitOutcome(True, update, self._fit_summary(norms, rates, first_loss), first_values)
        return FitOutcome(True, cfg.critic_updates, self._fit_summary(norms, rates, first_loss), first_values)

    def _critic_rate(self) -> float:
        """The learning rate the critic's next update uses (the warm-up's current one)."""
        return float(self.critic_optimizer.param_groups[0]["lr"])

    def _mean_rate(self, rates: list[float]) -> float:
        """Mean of the rates the applied updates used; with none applied, the rate the next one will use."""
        return sum(rates) / len(rates) if rates else self._critic_rate()

    def _fit_summary(self, norms: list[float], rates: list[float], first_loss: float) -> dict[str, float]:
        """The K updates' metrics: mean gradient norm, first loss and the rate they used."""
        return {"critic_grad_norm": sum(norms) / len(norms), "critic_fit_loss": first_loss,
                "critic_lr": self._mean_rate(rates)}

    def _critic_metrics(self, batch: RolloutBatch, judged: CriticPass) -> dict[str, float]:
        """Value loss and explained variance of each set of values against this batch's targets."""
        # without a fit (an empty replay window) the rate the next update will use; the fit's own replaces it
        out: dict[str, float] = {"critic_lr": self._critic_rate(),
                                 "critic_updates_done": float(judged.fit.updates_done) if judged.fit else 0.0}
        if judged.fit is not None:
            out.update(judged.fit.metrics)
        measured: list[tuple[torch.Tensor, dict[str, float]]] = []
        for suffix, values in (("", judged.before), ("_used", judged.used), ("_after", judged.after)):
            if values is None:
                continue
            # the orders hand one tensor under two names (judge_then_fit: used is before; the
            # others: used is after): its targets and loss are computed once
            same = next((m for v, m in measured if v is values), None)
            if same is None:
                same = self._fit_metrics(batch, values)
                measured.append((values, same))
            out.update(_suffixed(same, suffix))
        return out

    def _fit_metrics(self, batch: RolloutBatch, values: torch.Tensor) -> dict[str, float]:
        """``value_loss``, ``explained_variance`` and ``value_mean`` of ``values`` against the batch's targets."""
        mask = batch.action_mask
        _, targets = skip_observation_gae(batch.rewards, values, mask, self.cfg.gamma, self.cfg.lambda_critic)
        loss, critic_metrics = value_loss(values, targets, mask, batch.token_normalizer)
        return {"value_loss": float(loss), "explained_variance": critic_metrics["explained_variance"],
                "value_mean": critic_metrics["value_mean"], **endpoint_squared_errors(values, targets, mask)}

    def _advantages(self, batch: RolloutBatch, values: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        cfg, mask = self.cfg, batch.action_mask
        lam = length_adaptive_lambda(mask.sum(dim=1), cfg.lambda_alpha)
        advantages, _ = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, lam)
        if cfg.normalize_advantages:
            advantages = whiten(advantages, mask, self.sum_over_ranks)
        metrics["lambda_mean"] = float(lam.mean())
        metrics["adv_mean"] = float(advantages[mask].mean()) if bool(mask.any()) else 0.0
        return advantages

    def _policy_update(self, batch: RolloutBatch, advantages: torch.Tensor, timer: PhaseTimer) -> dict[str, float]:
        cfg = self.cfg
        with timer.phase("policy_forward"):
            logprobs, entropy = policy_forward(self.policy, batch, with_entropy=self.regularizer.needs_entropy)
        with timer.phase("arithmetic"):
            dis_loss, dis_metrics = dis_policy_loss(logprobs, batch.rollout_logprobs, advantages, batch.action_mask,
                                                    cfg.eps_low, cfg.eps_high, batch.token_normalizer)
        with timer.phase("policy_forward"):  # the reference's forward, when the KL penalty is on
            extra, extra_metrics = self.regularizer.loss(batch, logprobs, entropy)
        loss = dis_loss + extra
        result = guarded_update(loss, self.policy_optimizer, cfg.max_grad_norm, vote=self.vote,
                                signal_tokens=policy_signal_tokens(logprobs, batch, cfg, dis=True))
        timer.add("policy_backward", result.backward_s)
        timer.add("policy_optimizer", result.step_s)
        return {**dis_metrics, **extra_metrics, "policy_loss": loss.item(), "policy_grad_norm": result.grad_norm,
                "skipped_nonfinite": 1.0 if result.refused else 0.0,
                "policy_update_skipped_empty": 1.0 if result.empty else 0.0}

    def _after_policy_update(self, update: dict[str, float]) -> None:
        """After a policy update that was not refused: an EMA reference follows the policy only if it moved."""
        if not update["policy_update_skipped_empty"]:
            self.regularizer.after_policy_update(self.policy)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.cfg.critic_order == "replay_then_judge":
            state["replay_window"] = self.window.state_dict()
        if self.shrinkage is not None:
            state["shrinkage_window"] = self.shrinkage.state_dict()
        if self.rewarm_window is not None:
            state["rewarm"] = {"left": self.rewarm_left, "window": self.rewarm_window.state_dict()}
        return state

    def forget(self) -> None:
        """The replay window's returns and the shrinkage's rewards were earned under the old
        preference; with ``critic_rewarm_rollouts`` the critic (just reset) re-warms first."""
        self.window.clear()
        if self.shrinkage is not None:
            self.shrinkage.clear()
        if self.rewarm_window is not None:
            self.rewarm_window.clear()
            self.rewarm_left = self.cfg.critic_rewarm_rollouts

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "replay_window" in state:
            device = next(self.critic.parameters()).device
            self.window.load_state_dict(state["replay_window"], device)
        if self.shrinkage is not None and "shrinkage_window" in state:
            self.shrinkage.load_state_dict(state["shrinkage_window"])
        if self.rewarm_window is not None and "rewarm" in state:
            self.rewarm_left = int(state["rewarm"]["left"])
            self.rewarm_window.load_state_dict(state["rewarm"]["window"], next(self.critic.parameters()).device)

