"""The key/value cache of the running batch, left-padded to a common length.

Continuous batching needs sequences of different lengths to share one decode
step. Each running sequence is a row of a transformers ``DynamicCache`` (keys and
values ``[B, heads, L, head_dim]`` per layer); a shorter row is padded on the
left, and a ``[B, L]`` attention mask marks its real positions. Because the
model gets explicit ``position_ids`` (the count of a row's real tokens), the
padding changes neither the rotary positions nor (being masked) the attention
of any row.

- New sequences are prefilled together (their prompts left-padded to the longest,
  with a mask) and their cache joins by padding the shorter side on the left and
  concatenating along the batch; the padding columns are zeroed first.
- A finished sequence leaves by ``index_select`` on the batch; columns that
  became padding in every remaining row are then cut from the left.
- A decode step appends one column to every row (the model hands its new
  keys/values to the cache layer; we extend the mask). The batch's layers are
  :class:`GrowingLayer` s: the column is written in place into a buffer with room
  to spare, where ``DynamicLayer`` would concatenate and so copy the whole cache
  at every step.

Only full-attention layers (``DynamicLayer``) are supported: a sliding-window
layer drops old columns on its own, which would break the alignment of mask and
cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer


def check_layers(cache: DynamicCache) -> None:
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or getattr(layer, "is_sliding", False):
            raise NotImplementedError(f"cache layer {i} is a {type(layer).__name__}; continuous batching "
                                      "supports full-attention DynamicLayer caches only")


MIN_HEADROOM = 64
"""Free columns a layer's buffer gets at least when it is (re)built: decode steps before it grows."""
GROWTH = 0.5
"""A rebuilt buffer gets room for this share of its length more (geometric growth: the copies
cost O(1) per decode step on average, the spare memory is at most this share)."""


def _capacity(length: int) -> int:
    return length + max(MIN_HEADROOM, int(length * GROWTH))


def left_padded(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack ``[b_i, H, l_i, D]`` parts along the batch into a buffer ``[sum b_i, H, capacity, D]``
    whose first ``length`` columns hold each part right-aligned after zero columns (the padding is
    masked, but must be finite: attention multiplies it by a zero weight)."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    buffer = first.new_empty(rows, first.shape[1], _capacity(length), first.shape[3])
    row = 0
    for part in parts:
        pad = length - part.shape[2]
        buffer[row:row + part.shape[0], :, :pad] = 0
        buffer[row:row + part.shape[0], :, pad:length] = part
        row += part.shape[0]
    return buffer


def _regrown(cached: torch.Tensor, needed: int) -> torch.Tensor:
    """A buffer ``[B, H, capacity, D]`` with room for ``needed`` columns (and :func:`_capacity`'s
    headroom beyond), holding ``cached [B, H, L, D]`` in its first ``L`` columns."""
    buffer = cached.new_empty(cached.shape[0], cached.shape[1], _capacity(needed), cached.shape[3])
    buffer[:, :, :cached.shape[2]] = cached
    return buffer


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys``/``values`` ``[B, H, L, D]`` are the first ``L``
    columns of larger buffers: :meth:`update` writes new columns in place and rebuilds the buffers
    (with :func:`_capacity` room) only when they are full.

    Only the batches (:class:`RaggedKVBatch`, :class:`.flat_kv.FlatKVBatch`) change its rows and
    columns (they build new layers); DynamicLayer's own reshaping methods (crop, batch selection)
    are not used on it.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        """``keys``/``values``: buffers ``[B, H, capacity >= length, D]`` whose first ``length`` columns are the cache."""
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self._key_buffer, self._value_buffer = keys, values
        self.expose(length)

    def expose(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # reads only the buffers, never the exposed views: a compiled body (torch.compile) would
        # otherwise take a buffer and a view of it as two inputs, one of them written in place
        start = self._length
        end = start + key_states.shape[2]
        if end >= self._key_buffer.shape[2]:  # never full after an update: one case fewer to compile
            self._key_buffer = _regrown(self._key_buffer[:, :, :start], end)
            self._value_buffer = _regrown(self._value_buffer[:, :, :start], end)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.expose(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # the int, not ``self.keys.shape``: transformers' mask builder asks for the length inside the
        # model's forward, and a compiled body that read the exposed view would take it as an input
        # aliasing the buffer that update() writes (inductor fails on that)
        return self._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def columns(self, index: torch.Tensor) -> "GrowingLayer":
        """A layer holding only the columns at ``index`` (in that order), every row."""
        n = index.numel()
        keys, values = _regrown(self.keys[:, :, :0], n), _regrown(self.values[:, :, :0], n)
        keys[:, :, :n] = self.keys.index_select(2, index)
        values[:, :, :n] = self.values.index_select(2, index)
        return GrowingLayer(keys, values, n)

    def selected(self, index: torch.Tensor, first: int) -> "GrowingLayer":
        """A layer of the rows at ``index`` without the columns before ``first``."""
        # selecting from the column slice gives contiguous buffers (a slice of the selection would
        # keep the old buffer's strides, and a compiled body compiles again for each new stride)
        return GrowingLayer(self._key_buffer[:, :, first:].index_select(0, index),
                            self._value_buffer[:, :, first:].index_select(0, index), self._length - first)


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

    def append(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add the rows of a prefill: ``cache`` of ``[k, H, L, D]`` per layer and ``mask`` ``[k, L]``, 1 at each
        row's real (right-aligned) prompt positions. Padding columns are zeroed in place (the cache is
        handed over): their keys and values came from padding tokens and must stay finite under a zero
        attention weight."""
        check_layers(cache)
        length = mask.shape[1]
        padding = (mask == 0)[:, None, :, None]
        parts = [(layer.keys.masked_fill_(padding, 0), layer.values.masked_fill_(padding, 0))
                 for layer in cache.layers]
        if self.cache is None:
            self.cache, self.mask = cache, mask
            cache.layers = [GrowingLayer(left_padded([keys], length), left_padded([values], length), length)
                            for keys, values in parts]
            return
        target = max(self.length, length)
        grow_old, grow_new = target - self.length, target - length
        self.cache.layers = [
            GrowingLayer(left_padded([mine.keys, keys], target), left_padded([mine.values, values], target), target)
            for mine, (keys, values) in zip(self.cache.layers, parts)]
        self.mask = torch.cat([F.pad(self.mask, (grow_old, 0)), F.pad(mask, (grow_new, 0))])

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order) and drop all-padding columns."""
        if not keep:
            self.cache = self.mask = None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).long().argmax())  # first column some row still uses
        self.cache.layers = [layer.selected(index, first) for layer in self.cache.layers]
        self.mask = mask[:, first:]

    def step_mask(self) -> torch.Tensor:
        """``[B, L + 1]`` attention mask of a decode step (the new token is real)."""
        assert self.mask is not None
        return F.pad(self.mask, (0, 1), value=1)

    def commit_step(self, step_mask: torch.Tensor) -> None:
        """Record that a decode step with ``step_mask`` appended one column to every row."""
        self.mask = step_mask
