"""The seam between the learner loop and a learning rule.

The learner (trainer/) builds policy, critic and optimisers, collates joined
rollouts into a :class:`~online_sao.batch.RolloutBatch` and calls
:meth:`Algorithm.step`. SAO and the baselines (SAO.md section 4) implement it;
:func:`online_sao.algorithms.build_algorithm` picks one from the configuration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from online_sao.batch import RolloutBatch


class Algorithm(ABC):
    """One learning rule. ``step`` updates the models in place and returns float metrics.

    A step whose loss or gradients are not finite must change no weights and
    report ``skipped_nonfinite = 1.0`` in its metrics.
    """

    needs_critic: bool = True
    """Whether the learner must build a critic for this rule."""
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
