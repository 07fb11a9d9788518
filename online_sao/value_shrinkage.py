"""The critic's values shrunk toward, or levelled at, a running mean of rewards (our additions,
not in the paper).

Online, on the drifting-style scenario, the critic's values on a step's *new* answers, taken
before its updates, predicted their returns no better than a constant (docs/EXPERIMENTS.md
section 11): a baseline that is worse than a constant adds variance to every token's advantage
instead of removing it. So each value is replaced by

    V'_t = m + alpha * (V_t - m)

with ``m`` the mean reward of the last ``W`` rollouts of applied steps (this step's excluded,
as in the running-mean baseline) and ``alpha`` the least-squares slope of the returns on the
values, both taken relative to ``m``, over the out-of-sample pairs (V_t, G_t) of every action
token of those rollouts (the values they were judged with, before their step's updates),
clamped to [0, 1]:

    alpha = clamp( sum (V - m)(G - m) / sum (V - m)^2, 0, 1 )

``alpha = 1`` keeps the critic's values; ``alpha = 0`` is the running-mean baseline (the
advantages still come from GAE with the length-adaptive lambda). Fewer than
:data:`MIN_ROLLOUTS` rollouts in the window give ``alpha = 0`` and, with an empty window,
``m`` = the step's own mean reward.

Levelling (``value_level_window``) keeps the critic's course along each answer and takes its
level from the same ``m``: ``V'_t = m + V_t - V_first`` (:func:`anchor_level`), ``V_first``
the value at the answer's first action token. With ``lambda = 1`` the first token's advantage
is then the running-mean one, ``R - m``, and a later token's ``R - m - (V_t - V_first)``: the
part of the reward the answer's earlier tokens already predicted is taken off. A critic whose
level follows its last few batches (seen in drift.yaml: its mean value moved by up to 0.2 from
one step to the next) no longer passes that movement to the advantages.

Under data parallelism every rank keeps its own rollouts'
sums; :meth:`ShrinkageWindow.estimate` adds them over ranks, so every rank uses one ``m`` and
one ``alpha``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from online_sao.advantages import SumOverRanks, local_sum

MIN_ROLLOUTS = 8
"""Rollouts the window needs before alpha is estimated: a slope on fewer answers swings with
one of them (0 below)."""
MIN_VALUE_SPREAD = 1e-8
"""Smallest ``sum (V - m)^2`` a slope is taken on: a critic whose values all equal ``m`` says
nothing about the returns (alpha 0)."""

# Columns of one rollout's row: count (1), total reward, action tokens, sum V, sum G, sum V G, sum V^2.
_COUNT, _REWARD, _TOKENS, _V, _G, _VG, _VV = range(7)


def rollout_sums(values: torch.Tensor, returns: torch.Tensor, rewards: torch.Tensor,
                 action_mask: torch.Tensor) -> torch.Tensor:
    """``values``, ``returns``, ``rewards`` ``[B, T]`` (rewards as placed per token) and the bool
    ``action_mask`` ``[B, T]`` -> ``[B, 7]`` float64: per rollout 1, its total reward, its number
    of action tokens and, over them, sum V, sum G, sum V G, sum V^2."""
    mask = action_mask.to(torch.float64)
    v = values.detach().double() * mask
    g = returns.detach().double() * mask
    ones = torch.ones(values.shape[0], dtype=torch.float64, device=values.device)
    return torch.stack([ones, rewards.detach().double().sum(dim=1), mask.sum(dim=1), v.sum(dim=1), g.sum(dim=1),
                        (v * g).sum(dim=1), (v * v).sum(dim=1)], dim=1)


def shrinkage_factor(totals: torch.Tensor) -> tuple[float, float]:
    """``[7]`` column sums of :func:`rollout_sums` over a window -> ``(m, alpha)`` (module
    docstring). An empty window gives ``m`` NaN (the caller then uses the step's own mean)."""
    count, reward, tokens, sv, sg, svg, svv = totals.tolist()
    if count == 0:
        return float("nan"), 0.0
    m = reward / count
    spread = svv - 2 * m * sv + tokens * m * m
    if count < MIN_ROLLOUTS or spread <= MIN_VALUE_SPREAD:
        return m, 0.0
    covariance = svg - m * sv - m * sg + tokens * m * m
    return m, min(1.0, max(0.0, covariance / spread))


def shrink(values: torch.Tensor, mean: float, alpha: float) -> torch.Tensor:
    """``m + alpha (V - m)`` elementwise, any shape."""
    return mean + alpha * (values - mean)


def anchor_level(values: torch.Tensor, action_mask: torch.Tensor, mean: float) -> torch.Tensor:
    """``values`` ``[B, T]`` with each rollout's level moved to ``mean``: ``m + V_t - V_first``,
    ``V_first`` the value at the rollout's first action token (bool ``action_mask`` ``[B, T]``;
    a rollout without one keeps its values shifted by its position 0's)."""
    first = action_mask.to(torch.int8).argmax(dim=1, keepdim=True)  # the first True of each row
    return mean + values - values.gather(1, first)


@dataclass(frozen=True)
class Shrinkage:
    """One step's ``m`` and ``alpha`` and the window they came from."""

    mean: float
    alpha: float
    rollouts: int


class ShrinkageWindow:
    """The :func:`rollout_sums` rows of the last ``capacity`` rollouts of applied steps."""

    def __init__(self, capacity: int, sum_over_ranks: SumOverRanks = local_sum) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.rows: deque[torch.Tensor] = deque(maxlen=capacity)
        self.sum_over_ranks = sum_over_ranks

    def __len__(self) -> int:
        return len(self.rows)

    def estimate(self, step_rewards: torch.Tensor) -> Shrinkage:
        """``m`` and ``alpha`` for a step whose rollouts' rewards are ``step_rewards`` ``[B, T]``
        (used for ``m`` only while the window is empty). Collective under data parallelism:
        every rank calls it at the same point."""
        own = torch.stack(list(self.rows)).sum(dim=0) if self.rows else torch.zeros(7, dtype=torch.float64)
        step = torch.tensor([step_rewards.shape[0], float(step_rewards.double().sum())], dtype=torch.float64)
        totals = self.sum_over_ranks(torch.cat([own, step]))
        mean, alpha = shrinkage_factor(totals[:7])
        if totals[_COUNT] == 0:
            mean = float(totals[8] / totals[7]) if totals[7] > 0 else 0.0
        return Shrinkage(mean, alpha, int(totals[_COUNT]))

    def add(self, sums: torch.Tensor) -> None:
        """Append the ``[B, 7]`` rows of an applied step (the oldest fall out past capacity)."""
        self.rows.extend(row.cpu() for row in sums.detach().double())

    def clear(self) -> None:
        self.rows.clear()

    def state_dict(self) -> list[list[float]]:
        return [row.tolist() for row in self.rows]

    def load_state_dict(self, rows: list[list[float]]) -> None:
        self.rows.clear()
        self.rows.extend(torch.tensor(row, dtype=torch.float64) for row in rows)
