"""Where SAO's K critic updates run relative to the values its advantages use (SAO.md section 3).

The paper's purpose for the K updates is values adapted to the current policy before they
are used. With a few rollouts per step, updates on the step's own rollouts (Monte-Carlo
targets) fit their own outcomes and shrink their advantages toward zero. Three orders:

- ``fit_then_judge``: K updates on the batch, then its values (the literal reading);
- ``judge_then_fit``: the batch's values from the critic as it stands (K updates per earlier
  step), then K updates on the batch;
- ``replay_then_judge``: K updates on a window of recent already-trained rollouts (never this
  step's), then the batch's values; the caller adds the batch to the window once its step
  is applied (:meth:`ReplayWindow.add`). An empty window (the first step) updates nothing.

Where the K updates fit the step's own batch, their first forward runs on that batch with the
critic as it stands: its values (``FitOutcome.first_values``) are the batch's values before the
step, so no separate forward computes them. The values after the updates cost one more forward;
``judge_then_fit`` uses them only for metrics and computes them when ``measure_after`` asks.

:func:`order_critic_updates` is the order alone: the K updates and the critic's forward are
passed in, so the order can be checked with any critic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from online_sao.batch import RolloutBatch

CriticOrder = Literal["fit_then_judge", "judge_then_fit", "replay_then_judge"]
CRITIC_ORDERS: tuple[CriticOrder, ...] = ("fit_then_judge", "judge_then_fit", "replay_then_judge")

REPLAY_PAD_ID = 0
"""Token id padding the window's rows on the right. Its value never matters: padding is outside
the attention mask, and a causal model's real positions do not read later ones."""


@dataclass
class FitOutcome:
    """What the K critic updates on one batch did."""

    stepped: bool
    """No update was refused (False: one was refused as non-finite and the rest did not run); updates
    on a batch without action tokens are skipped, not applied (``updates_done`` counts the applied)."""
    updates_done: int
    """Updates applied."""
    metrics: dict[str, float]
    """The fitter's own metrics (loss of the first update on the data it fit, gradient norms)."""
    first_values: torch.Tensor
    """``[B, T]`` values of the fitted batch from the first update's forward, i.e. from the critic
    before any update, detached (given even when that update was refused)."""


@dataclass
class CriticPass:
    """Values of one batch, ``[B, T]`` each, no gradient."""

    before: torch.Tensor
    """From the critic before any update of this step."""
    used: torch.Tensor | None
    """The ones the advantages are computed from; None when an update was refused."""
    after: torch.Tensor | None
    """From the critic after every update of this step (None when refused)."""
    fit: FitOutcome | None
    """The K updates, or None when none ran (replay_then_judge with an empty window)."""


Fit = Callable[[RolloutBatch], FitOutcome]
"""K critic updates toward the Monte-Carlo targets of a batch."""
Evaluate = Callable[[RolloutBatch], torch.Tensor]
"""The critic's values ``[B, T]`` of a batch, without gradient."""


def order_critic_updates(order: CriticOrder, batch: RolloutBatch, fit: Fit, evaluate: Evaluate,
                         window: RolloutBatch | None = None, measure_after: bool = True) -> CriticPass:
    """Run ``fit`` and ``evaluate`` in ``order``; ``window`` is replay_then_judge's data
    (None or ignored otherwise). A refused fit leaves ``used`` and ``after`` None.
    ``measure_after``: under ``judge_then_fit``, evaluate the batch after the updates for
    ``after`` (metrics only; None otherwise). The other orders always do: their ``used`` is it."""
    if order == "judge_then_fit":
        outcome = fit(batch)
        before = outcome.first_values
        after = evaluate(batch) if outcome.stepped and measure_after else None
        return CriticPass(before, before if outcome.stepped else None, after, outcome)
    if order == "fit_then_judge":
        outcome = fit(batch)
        after = evaluate(batch) if outcome.stepped else None
        return CriticPass(outcome.first_values, after, after, outcome)
    if order == "replay_then_judge":
        before = evaluate(batch)
        if window is None:
            return CriticPass(before, before, before, None)
        outcome = fit(window)
        after = evaluate(batch) if outcome.stepped else None
        return CriticPass(before, after, after, outcome)
    raise ValueError(f"unknown critic order {order!r}; one of {CRITIC_ORDERS}")


@dataclass
class _Row:
    input_ids: torch.Tensor  # [n] long
    action_mask: torch.Tensor  # [n] bool
    rewards: torch.Tensor  # [n] float


class ReplayWindow:
    """The last ``capacity`` rollouts of applied steps, as the critic needs them (tokens,
    action mask, rewards). Under data parallelism each rank holds its own shares; a checkpoint
    keeps rank 0's window, which every rank then restores (any recent rollouts serve)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.rows: deque[_Row] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, batch: RolloutBatch) -> None:
        """Append every row of ``batch`` (the oldest rows fall out past ``capacity``)."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        for b, n in enumerate(lengths):
            self.rows.append(_Row(batch.input_ids[b, :n].detach().clone(), batch.action_mask[b, :n].detach().clone(),
                                  batch.rewards[b, :n].detach().clone()))

    def batch(self) -> RolloutBatch | None:
        """The window right-padded into one batch (None when empty). Only the fields the critic
        reads are real: behaviour log-probs and versions are 0, temperatures and top-p 1, groups -1;
        ``token_normalizer`` None (the window's own action-token count)."""
        if not self.rows:
            return None
        b, t = len(self.rows), max(len(r.input_ids) for r in self.rows)
        device = self.rows[0].input_ids.device
        input_ids = torch.full((b, t), REPLAY_PAD_ID, dtype=torch.long, device=device)
        attention = torch.zeros((b, t), dtype=torch.bool, device=device)
        actions = torch.zeros((b, t), dtype=torch.bool, device=device)
        rewards = torch.zeros((b, t), dtype=torch.float32, device=device)
        for i, row in enumerate(self.rows):
            n = len(row.input_ids)
            input_ids[i, :n], attention[i, :n], actions[i, :n], rewards[i, :n] = (
                row.input_ids, True, row.action_mask, row.rewards)
        return RolloutBatch(input_ids=input_ids, attention_mask=attention, action_mask=actions,
                            rollout_logprobs=torch.zeros((b, t), device=device), rewards=rewards,
                            versions=torch.zeros((b, t), dtype=torch.long, device=device),
                            temperatures=torch.ones((b, t), device=device), top_ps=torch.ones((b, t), device=device),
                            group_ids=torch.full((b,), -1, dtype=torch.long, device=device))

    def clear(self) -> None:
        self.rows.clear()

    def state_dict(self) -> dict[str, Any]:
        """Plain lists (JSON): the learner checkpoints algorithm state as JSON."""
        return {"rows": [{"input_ids": r.input_ids.tolist(), "action_mask": r.action_mask.tolist(),
                          "rewards": r.rewards.tolist()} for r in self.rows]}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        self.rows.clear()
        for row in state["rows"]:
            self.rows.append(_Row(torch.tensor(row["input_ids"], dtype=torch.long, device=device),
                                  torch.tensor(row["action_mask"], dtype=torch.bool, device=device),
                                  torch.tensor(row["rewards"], dtype=torch.float32, device=device)))
