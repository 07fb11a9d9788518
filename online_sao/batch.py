"""Typed rollouts and the padded tensor batch the algorithms consume.

Token alignment used everywhere in online_sao: a trajectory is one sequence of
token ids ``x_0 .. x_{T-1}``. Position ``t`` of every ``[B, T]`` tensor describes
token ``x_t``: ``action_mask[b, t]`` is True when ``x_t`` was sampled by the
policy, ``rollout_logprobs[b, t]`` is the behaviour log-probability of ``x_t``
given ``x_<t`` (0 where not an action), ``values[b, t]`` is the critic's value
of the state just before ``x_t`` is emitted (computed from the hidden state at
position ``t - 1``; see :func:`shift_to_tokens`). Position 0 is never an action.

The models themselves run on packed rows, not on this padded layout
(:class:`PackedLayout`): the forward helpers pack a batch's rollouts into as few
rows as fit, run the model with per-rollout positions (from which transformers
builds a block-diagonal causal mask), and unpack the outputs into ``[B, T]``
again. A model whose architecture does not build that mask runs on the padded
layout instead (:func:`online_sao.modeling.packs_correctly` decides, once per model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Rollout:
    """One rewarded trajectory, as the learner joins it from the stream.

    ``token_ids`` is the whole trajectory (prompt, responses, observations);
    ``action_mask``, ``logprobs`` and ``versions`` have its length, with
    ``logprobs``/``versions`` meaningful only where ``action_mask`` is True.
    ``rewards`` places each reward on a token index (the final reward on the
    last token); GAE credits a reward on a non-action token to the last action
    token before it. ``temperatures`` and ``top_ps`` are the sampling settings of
    each token (turns of one trajectory may differ), 1.0 off actions; left empty
    they mean 1.0 everywhere.
    """

    interaction_id: str
    token_ids: list[int]
    action_mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    rewards: dict[int, float]
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    group_id: int = -1
    segment: str | None = None
    """The segment key of the interaction (:mod:`online_sao.segments`); books only, no training input."""
    scores: dict[str, float] = field(default_factory=dict)
    """Named scores its rewards carried (``Reward.scores``, e.g. a judge's ``quality``), combined
    like the reward; books for the monitors and per-segment metrics only, no training input."""
    completed_at: float | None = None
    """When serving finished the interaction (``Interaction.completed_at``, serving's clock, Unix
    seconds); books for the learner's data-age metrics only, no training input."""
    defaulted: bool = False
    """Its final reward is ``reward.default_value``: its window closed with no reward of its own
    (``reward.on_missing`` default). Trained on like any other; the drift detector leaves it out
    (trainer/plasticity.py): a placeholder says nothing about the policy."""
    turns_of: list[str] = field(default_factory=list)
    """Ids of the earlier interactions of its conversation whose sampled turns train here (an unrated
    first turn its continuation absorbed), in turn order; the ledger lists them beside its own id
    (trainer/ledger.py). Books only, no training input."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        self.temperatures = self.temperatures or [1.0] * n
        self.top_ps = self.top_ps or [1.0] * n
        if not (len(self.action_mask) == len(self.logprobs) == len(self.versions) == len(self.temperatures)
                == len(self.top_ps) == n):
            raise ValueError(f"rollout {self.interaction_id}: per-token lists disagree in length")
        if n and self.action_mask[0]:
            raise ValueError(f"rollout {self.interaction_id}: token 0 cannot be an action")
        if any(not 0 <= i < n for i in self.rewards):
            raise ValueError(f"rollout {self.interaction_id}: reward index outside the trajectory")
        if any(not temperature > 0 for temperature in self.temperatures):
            raise ValueError(f"rollout {self.interaction_id}: temperature must be positive")
        if any(not 0 < top_p <= 1 for top_p in self.top_ps):
            raise ValueError(f"rollout {self.interaction_id}: top_p must be in (0, 1]")

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards.values()))

    @property
    def policy_version(self) -> int:
        """The newest version that sampled any of its action tokens (0 when it has none)."""
        return max((v for v, action in zip(self.versions, self.action_mask) if action), default=0)


def rollouts_to_json(rollouts: list[Rollout]) -> list[dict[str, Any]]:
    """Rollouts as JSON-ready dicts (reward positions become [index, value] pairs). The per-token
    lists are copied as lists: ``dataclasses.asdict`` copies every number on its own, which made
    a checkpoint of the registry's window of recent rollouts cost 0.1-0.15 s of each learner cycle."""
    return [{**{f.name: _copied(getattr(r, f.name)) for f in fields(r)},
             "rewards": [[int(k), float(v)] for k, v in r.rewards.items()]} for r in rollouts]


def _copied(value: Any) -> Any:
    """A list or dict of plain values copied (its items are immutable), anything else as it is."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def rollouts_from_json(payload: list[dict[str, Any]]) -> list[Rollout]:
    """The rollouts :func:`rollouts_to_json` encoded (Python floats round-trip exactly through JSON)."""
    return [Rollout(**{**item, "rewards": {int(k): float(v) for k, v in item["rewards"]}}) for item in payload]


@dataclass
class RolloutBatch:
    """Right-padded tensors of a learner step. Shapes: B rollouts, T tokens."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    action_mask: torch.Tensor  # [B, T] bool, True on tokens sampled by the policy
    rollout_logprobs: torch.Tensor  # [B, T] float, behaviour log-probs (0 off actions)
    rewards: torch.Tensor  # [B, T] float, reward placed on tokens (0 elsewhere)
    versions: torch.Tensor  # [B, T] long, policy version that sampled each action token
    temperatures: torch.Tensor  # [B, T] float, sampling temperature of each token (1 off actions and padding)
    top_ps: torch.Tensor  # [B, T] float, sampling top_p of each token (1 off actions and padding)
    group_ids: torch.Tensor  # [B] long, prompt group for grpo (-1 when ungrouped)
    interaction_ids: list[str] = field(default_factory=list)
    policy_version: int = 0
    """Version of the policy this step updates (for version-lag metrics)."""
    token_normalizer: float | None = None
    """Denominator N of the token-mean losses. None: this batch's action-token count.
    Data-parallel ranks set it so that the mean over ranks equals the global mean."""
    step_rewards: list[float] | None = None
    """Total reward of every rollout of the step, in the order rank 0 took them, when this batch
    is one rank's share of the step (None: the batch is the whole step). Rules whose state follows
    the whole step (running_mean's reward window) read it, so every rank keeps the same state."""

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "RolloutBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return RolloutBatch(**moved)

    def select(self, rows: torch.Tensor | list[int]) -> "RolloutBatch":
        """The sub-batch of the given row indices (token_normalizer is dropped)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        fields = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        fields["interaction_ids"] = [self.interaction_ids[i] for i in idx.tolist()] if self.interaction_ids else []
        fields["token_normalizer"] = None
        return RolloutBatch(**fields)


def collate(rollouts: list[Rollout], pad_token_id: int, policy_version: int = 0) -> RolloutBatch:
    """Right-pad rollouts into a :class:`RolloutBatch`."""
    if not rollouts:
        raise ValueError("cannot collate an empty list of rollouts")
    b, t = len(rollouts), max(len(r.token_ids) for r in rollouts)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, t), dtype=torch.bool)
    actions = torch.zeros((b, t), dtype=torch.bool)
    logprobs = torch.zeros((b, t), dtype=torch.float32)
    rewards = torch.zeros((b, t), dtype=torch.float32)
    versions = torch.zeros((b, t), dtype=torch.long)
    temperatures = torch.ones((b, t), dtype=torch.float32)
    top_ps = torch.ones((b, t), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        n = len(r.token_ids)
        input_ids[i, :n] = torch.tensor(r.token_ids, dtype=torch.long)
        attention[i, :n] = True
        actions[i, :n] = torch.tensor(r.action_mask, dtype=torch.bool)
        logprobs[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32) * actions[i, :n]
        versions[i, :n] = torch.tensor(r.versions, dtype=torch.long) * actions[i, :n]
        temperatures[i, :n] = torch.where(actions[i, :n], torch.tensor(r.temperatures, dtype=torch.float32), 1.0)
        top_ps[i, :n] = torch.where(actions[i, :n], torch.tensor(r.top_ps, dtype=torch.float32), 1.0)
        for pos, value in r.rewards.items():
            rewards[i, pos] += value
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        action_mask=actions,
        rollout_logprobs=logprobs,
        rewards=rewards,
        versions=versions,
        temperatures=temperatures,
        top_ps=top_ps,
        group_ids=torch.tensor([r.group_id for r in rollouts], dtype=torch.long),
        interaction_ids=[r.interaction_id for r in rollouts],
        policy_version=policy_version,
    )


def step_rewards(rollouts: list[Rollout]) -> list[float]:
    """Total reward of each rollout (float32 sums, as ``RolloutBatch.rewards.sum(dim=1)`` adds them)."""
    return [float(torch.tensor(list(r.rewards.values()), dtype=torch.float32).sum()) for r in rollouts]


def shift_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """Move outputs computed at position t-1 (next-token predictions, values of the
    state before token t) to position t. ``[B, T, ...]`` -> ``[B, T, ...]``; position 0 gets 0."""
    out = torch.zeros_like(per_position)
    out[:, 1:] = per_position[:, :-1]
    return out


@dataclass(frozen=True)
class PackedLayout:
    """Where the rollouts of a right-padded ``[B, T]`` batch sit when packed into ``R`` rows of ``C`` tokens.

    Rollouts are placed first-fit in order of decreasing length, each whole and
    contiguous inside one row, so a row holds several short rollouts where the
    padded batch held one. The rows are as long as the longest rollout, or a
    little longer where that saves whole rows without more attention work
    (:func:`row_capacity`), so the per-token work (projections, MLP, LM head)
    shrinks with the padding and attention costs no more. A model run on
    :meth:`pack`\ ed ids with :attr:`position_ids`
    (each rollout counting from 0), no attention mask and no cache sees each
    rollout alone: transformers builds the block-diagonal causal mask from the
    restarts of the positions (its packed-sequence format). Not every architecture
    does (OPT does not); :func:`online_sao.modeling.packs_correctly` finds those.
    """

    rows: int
    """R: packed rows."""
    capacity: int
    """C: tokens per row, at least the longest rollout (:func:`row_capacity`)."""
    batch_index: torch.Tensor
    """[N] long: the rollout of each real token (N real tokens in the batch)."""
    token_index: torch.Tensor
    """[N] long: its position in the rollout."""
    packed_row: torch.Tensor
    """[N] long: its packed row."""
    packed_col: torch.Tensor
    """[N] long: its position in that row."""
    position_ids: torch.Tensor
    """[R, C] long: each real token's position in its rollout; 0 on the padding that ends a row (each
    padding token then forms a sequence of its own and attends only to itself)."""
    batch_shape: tuple[int, int]
    """(B, T) of the padded batch."""

    @property
    def real_tokens(self) -> int:
        return int(self.batch_index.numel())

    @property
    def padding_share(self) -> float:
        """Share of the packed positions that hold no token."""
        return 1.0 - self.real_tokens / (self.rows * self.capacity)

    def pack(self, padded: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[R, C, ...]``: each real token's entry moved to its packed place, ``fill`` elsewhere."""
        out = padded.new_full((self.rows, self.capacity, *padded.shape[2:]), fill)
        out[self.packed_row, self.packed_col] = padded[self.batch_index, self.token_index]
        return out

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[R, C, ...]`` -> ``[B, T, ...]``: each real token's entry back in its rollout, 0 on padding.
        Differentiable: gradients flow to the packed entries of real tokens only."""
        out = packed.new_zeros((*self.batch_shape, *packed.shape[2:]))
        return out.index_put((self.batch_index, self.token_index), packed[self.packed_row, self.packed_col])


def padded_share(attention_mask: torch.Tensor) -> float:
    """Share of a ``[B, T]`` padded batch's positions that hold no token."""
    return 1.0 - float(attention_mask.sum()) / max(attention_mask.numel(), 1)


ATTENTION_BUDGET_TRIALS = 48
"""First-fit passes the row-length search may spend per batch. It runs in Python on every step;
for the 16-64 rollouts of a step it needs a handful; on a batch so large that it would need
more, the best length found within them stands (at worst the longest rollout's)."""


def _first_fit(sizes: list[int], capacity: int) -> tuple[int, list[int], list[int]]:
    """First-fit by decreasing length into rows of ``capacity`` tokens: (rows, row of each, offset in its row)."""
    free: list[int] = []  # tokens left in each packed row
    row_of, offset_of = [0] * len(sizes), [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        row = next((r for r, room in enumerate(free) if room >= sizes[i]), len(free))
        if row == len(free):
            free.append(capacity)
        row_of[i], offset_of[i] = row, capacity - free[row]
        free[row] -= sizes[i]
    return len(free), row_of, offset_of


def row_capacity(sizes: list[int]) -> int:
    """Row length for packing rollouts of these lengths: the one with the fewest packed slots
    (rows x length) among lengths whose attention work (rows x length^2) is no more than that of
    rows as long as the longest rollout.

    Rows exactly as long as the longest rollout leave the last rows' slack as padding (about 10%
    of the slots at lognormal sigma 1); a slightly longer row often saves a whole row. Under that
    budget neither the per-token work (projections, MLP, head: ~ slots) nor the attention grows,
    so a longer row chosen here is never more work for the model."""
    longest, total = max(sizes), sum(sizes)
    rows = _first_fit(sizes, longest)[0]
    best_slots, best = rows * longest, longest
    trials = 0
    for fewer in range(rows - 1, 0, -1):
        low = max(longest, -(-total // fewer))  # fewer rows need at least this many tokens each
        high = math.isqrt(rows * longest * longest // fewer)  # the attention budget at this many rows
        if low > high:
            break  # low grows faster than high as the rows get fewer: no later count fits either
        fits = None
        while low <= high and trials < ATTENTION_BUDGET_TRIALS:  # smallest length that fits in `fewer` rows
            middle = (low + high) // 2
            used = _first_fit(sizes, middle)[0]
            trials += 1
            if used <= fewer:
                fits, high = (used, middle), middle - 1
            else:
                low = middle + 1
        if fits is not None and fits[0] * fits[1] < best_slots:
            best_slots, best = fits[0] * fits[1], fits[1]
        if trials >= ATTENTION_BUDGET_TRIALS:
            break
    return best


def pack_layout(attention_mask: torch.Tensor) -> PackedLayout:
    """The :class:`PackedLayout` of a right-padded batch (``attention_mask`` ``[B, T]`` bool, True on tokens),
    in rows of :func:`row_capacity` tokens.

    Raises ValueError when a row is not right-padded (a gap or left padding): the
    layout moves each rollout's tokens as one contiguous run."""
    b, t = attention_mask.shape
    device = attention_mask.device
    lengths = attention_mask.sum(dim=1)
    positions = torch.arange(t, device=device)
    if not torch.equal(attention_mask.bool(), positions.unsqueeze(0) < lengths.unsqueeze(1)):
        raise ValueError("pack_layout needs a right-padded batch (each row's tokens first, then padding)")
    sizes = lengths.tolist()
    capacity = row_capacity(sizes) if b and max(sizes) else t
    rows, row_of, offset_of = _first_fit(sizes, capacity)
    batch_index, token_index = attention_mask.nonzero(as_tuple=True)
    packed_row = torch.tensor(row_of, dtype=torch.long, device=device)[batch_index]
    packed_col = torch.tensor(offset_of, dtype=torch.long, device=device)[batch_index] + token_index
    position_ids = torch.zeros((rows, capacity), dtype=torch.long, device=device)
    position_ids[packed_row, packed_col] = token_index
    return PackedLayout(rows=rows, capacity=capacity, batch_index=batch_index, token_index=token_index,
                        packed_row=packed_row, packed_col=packed_col, position_ids=position_ids, batch_shape=(b, t))
