"""The key/value cache of the running batch, left-padded to a common length.

Continuous batching needs sequences of different lengths to share one decode
step. Each running sequence is a row of a transformers ``DynamicCache`` (keys and
values ``[B, heads, L, head_dim]`` per layer); a shorter row is padded on the
left, and a ``[B, L]`` attention mask marks its real positions. Because the
model gets explicit ``position_ids`` (the count of a row's real tokens), the
padding changes neither the rotary positions nor (being masked) the attention
of any row.

- A new sequence is prefilled alone (batch 1, no padding) and its cache joins
  by padding the shorter side on the left and concatenating along the batch.
- A finished sequence leaves by ``index_select`` on the batch; columns that
  became padding in every remaining row are then cut from the left.
- A decode step appends one column to every row (the model concatenates its new
  keys/values; we extend the mask).

Only full-attention layers (``DynamicLayer``) are supported: a sliding-window
layer drops old columns on its own, which would break the alignment of mask and
cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer


def _check_layers(cache: DynamicCache) -> None:
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or getattr(layer, "is_sliding", False):
            raise NotImplementedError(f"cache layer {i} is a {type(layer).__name__}; continuous batching "
                                      "supports full-attention DynamicLayer caches only")


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad ``[B, H, L, D]`` with ``n`` zero columns before position 0."""
    return F.pad(t, (0, 0, n, 0)) if n else t


class RaggedKVBatch:
    """Cache and attention mask of the running rows, in row order."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        """``[B, L]`` int64, 1 at a row's real cached positions."""

    def __len__(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        """Cached columns (the padded length L)."""
        return 0 if self.mask is None else self.mask.shape[1]

    def positions(self) -> torch.Tensor:
        """``[B, 1]`` position id of each row's next token (its real cached length)."""
        assert self.mask is not None
        return self.mask.sum(dim=1, keepdim=True)

    def append(self, cache: DynamicCache, length: int) -> None:
        """Add the cache of one sequence prefilled alone (``length`` tokens, no padding)."""
        _check_layers(cache)
        row_mask = torch.ones(1, length, dtype=torch.long, device=cache.layers[0].keys.device)
        if self.cache is None:
            self.cache, self.mask = cache, row_mask
            return
        target = max(self.length, length)
        grow_old, grow_new = target - self.length, target - length
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, grow_old), _pad_left(theirs.keys, grow_new)])
            mine.values = torch.cat([_pad_left(mine.values, grow_old), _pad_left(theirs.values, grow_new)])
        self.mask = torch.cat([F.pad(self.mask, (grow_old, 0)), F.pad(row_mask, (grow_new, 0))])

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order) and drop all-padding columns."""
        if not keep:
            self.cache = self.mask = None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).long().argmax())  # first column some row still uses
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self.mask = mask[:, first:]

    def step_mask(self) -> torch.Tensor:
        """``[B, L + 1]`` attention mask of a decode step (the new token is real)."""
        assert self.mask is not None
        return F.pad(self.mask, (0, 1), value=1)

    def commit_step(self, step_mask: torch.Tensor) -> None:
        """Record that a decode step with ``step_mask`` appended one column to every row."""
        self.mask = step_mask
