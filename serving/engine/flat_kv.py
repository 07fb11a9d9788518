"""The running batch's key/value cache as one flat row, prompts prefilled inside the decode step.

:mod:`.kv_batch` keeps one cache row per sequence, left-padded to the longest, and prefills new
prompts in a forward of their own. Here every sequence's cached columns sit side by side in a
single row (a transformers ``DynamicCache`` of batch 1), and each column carries its owner (the
sequence) and its position in that sequence. One forward serves a whole round: its queries are
each running sequence's last sampled token followed by every token of the prompts admitted in
the round, and a ``[Q, K + Q]`` additive mask lets a query see exactly the columns of its own
sequence at positions up to its own. Explicit ``position_ids`` give each query its sequence's
rotary position, and the keys are cached after their rotation, so where a column sits in the row
does not matter. The same logits as the padded layout (float rounding aside), with:

- no padding: a decode step attends over the real cached tokens only, however long the longest
  running sequence is;
- no separate prefill forward: a prompt joining the batch costs its tokens in the round's
  forward, not a forward of its own (on a CPU a forward's fixed cost is most of a decode step);
- no copy of the cache when a sequence joins or leaves: a leaving sequence's columns are marked
  dead and the row is compacted only when dead columns reach :data:`COMPACT_SHARE` of it.

New columns are written in place (:class:`.kv_batch.GrowingLayer`). Only full-attention
``DynamicLayer`` caches are supported, as for the padded layout, and the model must take a 4D
attention mask as given (transformers passes a prepared 4D mask through unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from serving.engine.kv_batch import GrowingLayer, check_layers, left_padded

DEAD = -1
"""Owner of a column whose sequence has left (no query owns it, so none attends to it)."""
COMPACT_SHARE = 0.5
"""Dead columns are cut out when they reach this share of the row: each compaction copies the
live columns once, so the copying stays proportional to the columns written."""


@dataclass(frozen=True)
class FlatStep:
    """The inputs of one forward and what its columns will be."""

    input_ids: torch.Tensor
    """``[1, Q]``: each running row's last token, then the new prompts' tokens."""
    position_ids: torch.Tensor
    """``[1, Q]``: each query's position in its own sequence."""
    mask: torch.Tensor
    """``[1, 1, Q, K + Q]`` additive attention mask (0 where a query may attend)."""
    last: torch.Tensor
    """``[R + P]`` long: the query whose logits sample each row's next token (running rows first,
    then the new prompts in order)."""
    owners: torch.Tensor
    """``[Q]`` owner of each query's column (on the host)."""
    positions: torch.Tensor
    """``[Q]`` position of each query's column (on the host; ``position_ids`` is its copy on the device)."""
    new_rows: list[int]
    """Owner ids given to the new prompts."""
    new_lengths: list[int]
    """Their prompt lengths."""


class FlatKVBatch:
    """The cache, its columns' owners and positions, and the running rows in row order."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.cache: DynamicCache | None = None
        self._owners = torch.empty(0, dtype=torch.long)
        self._positions = torch.empty(0, dtype=torch.long)
        self._width = 0  # columns in use (live and dead)
        self._dead = 0
        self.rows: list[int] = []
        """Owner id of each running row."""
        self.lengths: list[int] = []
        """Cached tokens of each running row (the position of its next token)."""
        self._next_owner = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Columns in the cache row, dead ones included."""
        return self._width

    def step(self, last_tokens: list[int], prompts: list[list[int]], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> FlatStep:
        """The inputs of a forward that advances every running row by its ``last_tokens`` entry
        (one per row, in row order) and prefills ``prompts``."""
        if len(last_tokens) != len(self.rows):
            raise ValueError(f"{len(last_tokens)} last tokens for {len(self.rows)} running rows")
        new_rows = list(range(self._next_owner, self._next_owner + len(prompts)))
        ids = list(last_tokens) + [t for p in prompts for t in p]
        owners = list(self.rows) + [o for o, p in zip(new_rows, prompts) for _ in p]
        positions = list(self.lengths) + [i for p in prompts for i in range(len(p))]
        last, end = list(range(len(self.rows))), len(self.rows)
        for p in prompts:
            end += len(p)
            last.append(end - 1)
        owner_q = torch.tensor(owners, dtype=torch.long)
        position_q = torch.tensor(positions, dtype=torch.long)
        owner_k = torch.cat([self._owners[:self._width], owner_q])
        position_k = torch.cat([self._positions[:self._width], position_q])
        visible = (owner_k[None, :] == owner_q[:, None]) & (position_k[None, :] <= position_q[:, None])
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        return FlatStep(torch.tensor([ids], dtype=torch.long, device=device), position_q[None].to(device),
                        mask[None, None].to(device), torch.tensor(last, dtype=torch.long, device=device),
                        owner_q, position_q, new_rows, [len(p) for p in prompts])

    def commit(self, step: FlatStep, cache: DynamicCache) -> None:
        """Record that the forward of ``step`` appended its columns to ``cache`` (the batch's own, or a
        fresh one when it held nothing); the new prompts become running rows after the others."""
        queries = step.owners.numel()
        if self.cache is None:
            check_layers(cache)
            cache.layers = [GrowingLayer(left_padded([layer.keys], queries), left_padded([layer.values], queries),
                                         queries) for layer in cache.layers]
            self.cache = cache
        self._append(step.owners, step.positions)
        self.lengths = [n + 1 for n in self.lengths] + step.new_lengths
        self.rows = self.rows + step.new_rows
        self._next_owner += len(step.new_rows)

    def discard(self) -> None:
        """Forget columns a failed forward may have written into some layers past the committed width."""
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.expose(self._width)

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order); the others' columns die."""
        if not keep:
            self._reset()
            return
        kept = set(keep)
        leaving = [self.rows[i] for i in range(len(self.rows)) if i not in kept]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if leaving:
            owners = self._owners[:self._width]
            dying = torch.isin(owners, torch.tensor(leaving, dtype=torch.long))
            self._dead += int(dying.sum())
            owners.masked_fill_(dying, DEAD)
        if self._dead >= COMPACT_SHARE * self._width:
            self._compact()

    def _append(self, owners: torch.Tensor, positions: torch.Tensor) -> None:
        end = self._width + owners.numel()
        if end > self._owners.numel():
            grown = max(end, 2 * self._owners.numel())
            self._owners = torch.cat([self._owners[:self._width], owners.new_empty(grown - self._width)])
            self._positions = torch.cat([self._positions[:self._width], positions.new_empty(grown - self._width)])
        self._owners[self._width:end] = owners
        self._positions[self._width:end] = positions
        self._width = end

    def _compact(self) -> None:
        assert self.cache is not None
        live = (self._owners[:self._width] != DEAD).nonzero().squeeze(1)
        self.cache.layers = [layer.columns(live.to(layer.keys.device)) for layer in self.cache.layers]
        self._owners = self._owners[live].clone()
        self._positions = self._positions[live].clone()
        self._width, self._dead = live.numel(), 0
