"""What the learner does when the users' preference moved: restore its ability to explore.

:class:`DriftResponse` watches the rewards of every trained step with
:class:`online_sao.drift.RewardDropDetector` (config ``drift.*``), except rewards the join gave
by default (``Rollout.defaulted``: no reward arrived, ``reward.on_missing`` default) and those of
answers sampled more than ``drift.max_version_lag`` versions back: neither says anything about the
current policy. On an alarm it

- moves the policy back towards its starting weights, ``start + policy_shrink * (policy - start)``
  (0: a restart; the starting policy samples every style at its starting share, so the newly
  preferred one is sampled again), and an EMA KL reference (``Trainables.ema_reference``) alike:
  it started where the policy did, and left behind it would pull the policy back to the old
  preference;
- with ``reset_critic``, puts the critic back to its initial weights (values fitted under the
  old preference mis-rank the new one's answers);
- with ``reset_optimizers``, clears the optimisers' moments (they point the old way);
- tells the learning rule to forget reward statistics gathered before the change
  (:meth:`online_sao.algorithm.Algorithm.forget`: the running-mean baselines' window).

With ``rollback_first`` an alarm first rolls policy, critic and EMA reference back to the newest
snapshot taken before the detector's reference window (optimiser moments cleared with
``reset_optimizers``; the rule's statistics kept: the users did not change) and opens a probation:
once ``recent`` rewards of answers sampled by the restored version or later have arrived, they are
tested against the alarm's reference window with the detector's own test, and only a drop restarts
as above. A fall of the learner's own quality is then undone without discarding the learned
preference (docs/EXPERIMENTS.md section 17). Snapshots are taken every ``recent`` trained rewards. With
``rollback_score`` (a named score of the rewards, e.g. a judge's ``quality``) an alarm rolls back
only when that score fell over the same two windows too (z at least ``rollback_score_z``): a
preference change lowers the reward while the answers' quality holds, and restarts at once.

Every rank holds the starting values of its own shard of each parameter (one more copy of
policy and critic in memory) and applies the same arithmetic to it; every rank sees every
step's rewards (the learner broadcasts the step's rollouts), so all ranks agree on the alarm
without a collective. The "start" is what :func:`trainer.startup.build_models` loaded, before
any checkpoint or value pre-training: the weights in ``model_dir`` and a freshly built critic.
The detector's books (its reward history, a probation, the scores) are checkpointed
(:meth:`DriftResponse.state_dict`): a learner restarted mid-window raises the alarm one that never
stopped raises. The weight snapshots a roll-back returns to are not (a policy's worth each, two with
an EMA reference): after a restart they are taken again, and an alarm before one exists restarts
instead of rolling back.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from online_sao.batch import Rollout
from online_sao.config import DriftConfig
from online_sao.drift import DriftSettings, RewardDropDetector, mean_shift
from trainer.distributed import sharded_parameters
from trainer.state import Trainables

log = logging.getLogger(__name__)


def snapshot(model: nn.Module | None) -> list[torch.Tensor] | None:
    """Detached copies of ``model``'s parameters (this rank's shards), in ``parameters()`` order."""
    return None if model is None else [p.detach().clone() for p in sharded_parameters(model)]


@torch.no_grad()
def shrink_towards(model: nn.Module, start: list[torch.Tensor], keep: float) -> None:
    """Every parameter ``p`` becomes ``start + keep * (p - start)`` in place (``keep`` in [0, 1])."""
    for p, p0 in zip(sharded_parameters(model), start, strict=True):
        p.mul_(keep).add_(p0, alpha=1.0 - keep)


def drift_counter(metrics: dict[str, float]) -> str | None:
    """The learner's counter a step's drift metrics add one to: ``drift_restarts`` or ``drift_rollbacks``
    when the step changed the policy (``drift_alarm``), None when it did not."""
    if metrics.get("drift_alarm", 0.0) <= 0:
        return None
    return "drift_rollbacks" if metrics.get("drift_rollback", 0.0) > 0 else "drift_restarts"


@dataclass
class Snapshot:
    """Policy, critic and EMA KL reference weights after ``seen`` trained rewards."""

    seen: int
    policy: list[torch.Tensor]
    critic: list[torch.Tensor] | None
    reference: list[torch.Tensor] | None = None
    """The EMA reference (``Trainables.ema_reference``; None without one): it followed the policy
    into the fall, and left there it would pull the restored policy back toward the fallen one."""


@dataclass
class Probation:
    """After a roll-back: the alarm's reference rewards and the rewards of answers sampled by the
    restored version (``from_version``) or later, gathered until there are ``recent`` of them."""

    reference: list[float]
    from_version: int
    rewards: list[float] = field(default_factory=list)


class DriftResponse:
    """The detector and the roll-back or restart it triggers (module docstring)."""

    def __init__(self, cfg: DriftConfig, trainables: Trainables) -> None:
        self.cfg = cfg
        self.trainables = trainables
        self.detector = RewardDropDetector(DriftSettings(cfg.recent, cfg.reference, cfg.min_drop, cfg.z_threshold))
        self.policy_start = snapshot(trainables.policy)
        self.critic_start = snapshot(trainables.critic) if cfg.reset_critic else None
        self.seen = 0
        """Trained rewards observed (a snapshot's clock)."""
        kept = (cfg.reference + cfg.recent) // cfg.recent + 2  # one at or before the reference window's start
        self.snapshots: deque[Snapshot] = deque(maxlen=kept)
        self.probation: Probation | None = None
        self.version_floor = 0
        """Rewards of answers sampled by an older version are left out of the test: a registry roll-back
        sets it to the version the restored weights are published as (:meth:`after_registry_rollback`)."""
        self.scores: deque[float] = deque()
        """The newest trained rollouts' ``rollback_score`` (NaN where missing), oldest first;
        empty without a ``rollback_score``."""

    def state_dict(self) -> dict[str, Any]:
        """The books a checkpoint keeps (module docstring; not the weight snapshots)."""
        p = self.probation
        return {"detector": self.detector.state_dict(), "seen": self.seen, "scores": list(self.scores),
                "version_floor": self.version_floor,
                "probation": None if p is None else {"reference": p.reference, "from_version": p.from_version,
                                                     "rewards": p.rewards}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        self.seen = int(state["seen"])
        self.version_floor = int(state.get("version_floor", 0))  # 0: a checkpoint from before the floor
        self.scores = deque(float(s) for s in state["scores"])
        p = state.get("probation")
        self.probation = None if p is None else Probation(list(p["reference"]), int(p["from_version"]),
                                                          list(p["rewards"]))
        self.snapshots.clear()

    def after_rollouts(self, rollouts: list[Rollout], next_version: int) -> dict[str, float]:
        """:meth:`after_step` on one trained step's rollouts: their rewards, the versions that
        sampled them and their ``rollback_score``. Both learners call this (trainer/learner.py and
        the in-process driver), so that both feed the detector and a probation alike. Rollouts whose
        reward is the join's default (``Rollout.defaulted``) are left out, counted in the metric
        ``drift_defaulted_rewards``: a reward outage gives every answer the default, whose run
        otherwise read as a preference change and restarted a policy whose users did not change."""
        rated = [r for r in rollouts if not r.defaulted]
        score = self.cfg.rollback_score
        metrics = self.after_step([r.total_reward for r in rated], [r.policy_version for r in rated], next_version,
                                  None if score is None else [r.scores.get(score, math.nan) for r in rated])
        metrics["drift_defaulted_rewards"] = float(len(rollouts) - len(rated))
        return metrics

    def after_step(self, rewards: list[float], versions: list[int] | None = None,
                   next_version: int = 0, scores: list[float] | None = None) -> dict[str, float]:
        """Feed one trained step's rewards (in order) and the policy versions that sampled them
        (None: all by the current policy); ``next_version``: the version the learner publishes
        next (a roll-back's restored weights); ``scores``: each rollout's ``drift.rollback_score``
        (NaN where it has none; None: none has). Rolls back or restarts on an alarm. Returns the
        detector's metrics: ``drift_alarm`` 1.0 on a step that changed the policy (published at
        once), ``drift_rollback`` 1.0 when that change was a roll-back."""
        versions = versions if versions is not None else [next_version] * len(rewards)
        rewards, versions, scores, stale = self._within_lag(rewards, versions, next_version, scores)
        alarm, metrics = self.detector.observe(rewards)
        metrics["drift_stale_rewards"] = float(stale)
        self.seen += len(rewards)
        if self.cfg.rollback_score is not None:
            self._keep_scores(scores if scores is not None else [math.nan] * len(rewards))
        failed = self._probation_failed(rewards, versions, metrics)
        rolled_back = False
        if alarm or failed:
            if failed and not alarm:  # rewards since the roll-back say nothing about after a restart
                self.detector.history.clear()
            # trained rewards up to the one that raised the alarm (a failed probation: the step's last)
            at_alarm = self.seen - (self.detector.rewards_after_alarm if alarm else 0)
            restored = self._snapshot_before(at_alarm - self.cfg.reference - self.cfg.recent)
            if (self.cfg.rollback_first and self.probation is None and not failed and restored is not None
                    and self._score_fell(at_alarm, metrics)):
                self.rollback(restored, next_version)
                rolled_back = True
            else:
                self.restart()
            self.snapshots.clear()  # what came after the restored weights, or before the restart
            self._log(metrics, rolled_back)
        elif self.cfg.rollback_first and (not self.snapshots or self.seen - self.snapshots[-1].seen >= self.cfg.recent):
            t = self.trainables
            self.snapshots.append(Snapshot(self.seen, snapshot(t.policy), snapshot(t.critic),
                                           snapshot(t.ema_reference)))
        metrics["drift_alarm"] = float(alarm or failed)
        metrics["drift_rollback"] = float(rolled_back)
        return metrics

    def _within_lag(self, rewards: list[float], versions: list[int], next_version: int, scores: list[float] | None
                    ) -> tuple[list[float], list[int], list[float] | None, int]:
        """The step's rewards, versions and scores of answers sampled within ``max_version_lag`` of
        ``next_version`` and not before :attr:`version_floor`, and how many were left out."""
        lag = self.cfg.max_version_lag
        if lag is None and self.version_floor == 0:
            return rewards, versions, scores, 0
        keep = [i for i, v in enumerate(versions)
                if v >= self.version_floor and (lag is None or next_version - v <= lag)]
        if len(keep) == len(rewards):
            return rewards, versions, scores, 0
        return ([rewards[i] for i in keep], [versions[i] for i in keep],
                None if scores is None else [scores[i] for i in keep], len(rewards) - len(keep))

    def _probation_failed(self, rewards: list[float], versions: list[int], metrics: dict[str, float]) -> bool:
        """Gather a probation's rewards; True when it ends with a drop (its drop and z go into
        ``metrics``). A probation ends either way once it holds ``recent`` rewards."""
        p = self.probation
        if p is None:
            return False
        p.rewards.extend(r for r, v in zip(rewards, versions, strict=True) if v >= p.from_version)
        if len(p.rewards) < self.cfg.recent:
            return False
        self.probation = None
        fell, drop, z = self.detector.test(p.reference, p.rewards[:self.cfg.recent])
        metrics["drift_probation_drop"], metrics["drift_probation_z"] = drop, z
        if fell:
            metrics["drift_drop"], metrics["drift_z"] = drop, z
            return True
        log.warning("reward drift: the rolled-back policy holds its level (drop %.3f, z=%.1f): no restart", drop, z)
        return False

    def _keep_scores(self, scores: list[float]) -> None:
        """The newest scores, enough to cover an alarm's two windows in this step or the last."""
        self.scores.extend(scores)
        while len(self.scores) > self.cfg.reference + self.cfg.recent + len(scores):
            self.scores.popleft()

    def _score_fell(self, at_alarm: int, metrics: dict[str, float]) -> bool:
        """Whether an alarm at ``at_alarm`` trained rewards is a roll-back by ``rollback_score``
        (module docstring): True without a score, or when the score's windows hold too few values
        to test; ``drift_score_drop``/``drift_score_z`` go into ``metrics`` when tested."""
        if self.cfg.rollback_score is None:
            return True
        first = self.seen - len(self.scores)  # the trained-reward index of self.scores[0]
        values = list(self.scores)
        reference = values[at_alarm - self.cfg.reference - self.cfg.recent - first:at_alarm - self.cfg.recent - first]
        recent = values[at_alarm - self.cfg.recent - first:at_alarm - first]
        reference, recent = [v for v in reference if not math.isnan(v)], [v for v in recent if not math.isnan(v)]
        if len(reference) < 2 or len(recent) < 2:
            return True
        drop, z = mean_shift(reference, recent)
        metrics["drift_score_drop"], metrics["drift_score_z"] = drop, z
        return z >= self.cfg.rollback_score_z

    def _snapshot_before(self, seen: int) -> Snapshot | None:
        """The newest snapshot taken at or before ``seen`` trained rewards."""
        return next((s for s in reversed(self.snapshots) if s.seen <= seen), None)

    def _log(self, metrics: dict[str, float], rolled_back: bool) -> None:
        if rolled_back:
            log.warning("reward drift: mean fell by %.3f (z=%.1f); policy and critic rolled back to their weights "
                        "before the reference window, on probation", metrics["drift_drop"], metrics["drift_z"])
            return
        log.warning("reward drift: mean fell by %.3f (z=%.1f); policy shrunk to %.2f of its distance from the "
                    "start%s%s", metrics["drift_drop"], metrics["drift_z"], self.cfg.policy_shrink,
                    ", critic reset" if self.critic_start is not None else "",
                    ", optimiser moments cleared" if self.cfg.reset_optimizers else "")

    def after_registry_rollback(self, republished_as: int) -> None:
        """The registry rolled the learner back to its champion, whose weights go out again as version
        ``republished_as``: the rewards and weight snapshots gathered since belong to the rejected line,
        and so do the rewards of its answers still on their way. Tested against them, the champion's own
        rewards (lower, when a monitor rejected a candidate that scored higher) raise an alarm that would
        restart the champion or restore the rejected weights. The detector starts again from the
        rewards of answers the restored weights sampled; a probation under way ends (its roll-back was
        undone too)."""
        self.version_floor = republished_as
        self.detector.history.clear()
        self.detector.alarm_reference = []
        self.scores.clear()
        self.snapshots.clear()
        self.probation = None

    def rollback(self, restored: Snapshot, next_version: int) -> None:
        t = self.trainables
        shrink_towards(t.policy, restored.policy, 0.0)
        if restored.critic is not None and t.critic is not None:
            shrink_towards(t.critic, restored.critic, 0.0)
        if restored.reference is not None and t.ema_reference is not None:
            shrink_towards(t.ema_reference, restored.reference, 0.0)
        self._clear_moments()
        self.probation = Probation(list(self.detector.alarm_reference), next_version)

    def restart(self) -> None:
        t = self.trainables
        shrink_towards(t.policy, self.policy_start, self.cfg.policy_shrink)
        if t.ema_reference is not None:
            # the same arithmetic: the reference starts where the policy did (build_reference), so
            # it stays as far behind the moved policy as before, instead of at the old preference
            shrink_towards(t.ema_reference, self.policy_start, self.cfg.policy_shrink)
        if self.critic_start is not None and t.critic is not None:
            shrink_towards(t.critic, self.critic_start, 0.0)
        self._clear_moments()
        self.probation = None
        t.algorithm.forget()

    def _clear_moments(self) -> None:
        if self.cfg.reset_optimizers:
            for optimizer in (self.trainables.optimizers.policy, self.trainables.optimizers.critic):
                if optimizer is not None:
                    optimizer.state.clear()
