"""What the learner does when the users' preference moved: restore its ability to explore.

:class:`DriftResponse` watches the rewards of every trained step with
:class:`online_sao.drift.RewardDropDetector` (config ``drift.*``). On an alarm it

- moves the policy back towards its starting weights, ``start + policy_shrink * (policy - start)``
  (0: a restart; the starting policy samples every style at its starting share, so the newly
  preferred one is sampled again);
- with ``reset_critic``, puts the critic back to its initial weights (values fitted under the
  old preference mis-rank the new one's answers);
- with ``reset_optimizers``, clears the optimisers' moments (they point the old way);
- tells the learning rule to forget reward statistics gathered before the change
  (:meth:`online_sao.algorithm.Algorithm.forget`: the running-mean baselines' window).

Every rank holds the starting values of its own shard of each parameter (one more copy of
policy and critic in memory) and applies the same arithmetic to it; every rank sees every
step's rewards (the learner broadcasts the step's rollouts), so all ranks agree on the alarm
without a collective. The "start" is what :func:`trainer.startup.build_models` loaded, before
any checkpoint or value pre-training: the weights in ``model_dir`` and a freshly built critic.
The detector's reward history is not checkpointed: after a restart it fills again.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from online_sao.config import DriftConfig
from online_sao.drift import DriftSettings, RewardDropDetector
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


class DriftResponse:
    """The detector and the restart it triggers (module docstring)."""

    def __init__(self, cfg: DriftConfig, trainables: Trainables) -> None:
        self.cfg = cfg
        self.trainables = trainables
        self.detector = RewardDropDetector(DriftSettings(cfg.recent, cfg.reference, cfg.min_drop, cfg.z_threshold))
        self.policy_start = snapshot(trainables.policy)
        self.critic_start = snapshot(trainables.critic) if cfg.reset_critic else None

    def after_step(self, rewards: list[float]) -> dict[str, float]:
        """Feed one trained step's rewards (in order); restart on an alarm. Returns the
        detector's metrics (``drift_alarm`` 1.0 on the step that restarted)."""
        alarm, metrics = self.detector.observe(rewards)
        if alarm:
            self.restart()
            log.warning("reward drift: mean fell by %.3f (z=%.1f); policy shrunk to %.2f of its distance from the "
                        "start%s%s", metrics["drift_drop"], metrics["drift_z"], self.cfg.policy_shrink,
                        ", critic reset" if self.critic_start is not None else "",
                        ", optimiser moments cleared" if self.cfg.reset_optimizers else "")
        return metrics

    def restart(self) -> None:
        t = self.trainables
        shrink_towards(t.policy, self.policy_start, self.cfg.policy_shrink)
        if self.critic_start is not None and t.critic is not None:
            shrink_towards(t.critic, self.critic_start, 0.0)
        if self.cfg.reset_optimizers:
            for optimizer in (t.optimizers.policy, t.optimizers.critic):
                if optimizer is not None:
                    optimizer.state.clear()
        t.algorithm.forget()
