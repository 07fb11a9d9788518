"""The running batch's left-padded KV cache: in-place growth, joining and leaving rows."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from serving.engine.kv_batch import MIN_HEADROOM, GrowingLayer, RaggedKVBatch

HEADS, DIM, LAYERS = 2, 4, 3


def prefilled(lengths: list[int], seed: int) -> tuple[DynamicCache, torch.Tensor, list[list[torch.Tensor]]]:
    """A cache as a prefill of prompts of ``lengths`` left-padded to the longest leaves it (NaN in the padding
    columns, which the batch must not keep), its ``[k, L]`` mask, and per row its real keys ``[H, length, D]``
    per layer."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths])
    cache, keys = DynamicCache(), [[] for _ in lengths]
    for layer in range(LAYERS):
        k, v = torch.randn(len(lengths), HEADS, longest, DIM, generator=g), torch.randn(len(lengths), HEADS, longest, DIM, generator=g)
        padding = (mask == 0)[:, None, :, None]
        cache.update(k.masked_fill(padding, float("nan")), v.masked_fill(padding, float("nan")), layer)
        for row, n in enumerate(lengths):
            keys[row].append(k[row, :, longest - n:])
    return cache, mask, keys


def test_a_growing_layer_holds_what_concatenation_would_across_its_growths():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, HEADS, 3, DIM, generator=g), torch.randn(2, HEADS, 3, DIM, generator=g)
    layer = GrowingLayer(keys.clone(), values.clone(), 3)
    for width in [1] * (2 * MIN_HEADROOM) + [3 * MIN_HEADROOM, 1]:  # single columns, then more than any headroom
        k, v = torch.randn(2, HEADS, width, DIM, generator=g), torch.randn(2, HEADS, width, DIM, generator=g)
        got_k, got_v = layer.update(k, v)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert layer.get_seq_length() == keys.shape[2]


def test_rows_keep_their_own_keys_right_aligned_through_joins_steps_and_leaves():
    batch = RaggedKVBatch()
    rows: dict[str, list[list[torch.Tensor]]] = {}  # row name -> per layer, its keys [H, len, D]
    order: list[str] = []
    g = torch.Generator().manual_seed(1)

    def join(names: list[str], lengths: list[int]) -> None:
        cache, mask, keys = prefilled(lengths, seed=len(rows))
        batch.append(cache, mask)
        for name, row_keys in zip(names, keys):
            rows[name] = [[k] for k in row_keys]
            order.append(name)

    def step() -> None:
        mask = batch.step_mask()
        for layer in range(LAYERS):
            k = torch.randn(len(order), HEADS, 1, DIM, generator=g)
            batch.cache.update(k, k.clone(), layer)
            for i, name in enumerate(order):
                rows[name][layer].append(k[i])
        batch.commit_step(mask)

    def check() -> None:
        assert len(batch) == len(order) and batch.cache.layers[0].keys.shape[2] == batch.length
        for i, name in enumerate(order):
            real = int(batch.mask[i].sum())
            assert batch.mask[i, batch.length - real:].all() and not batch.mask[i, :batch.length - real].any()
            assert batch.positions()[i, 0] == real
            for layer in range(LAYERS):
                want = torch.cat(rows[name][layer], dim=1)
                keys = batch.cache.layers[layer].keys[i]
                assert torch.equal(keys[:, batch.length - real:], want)
                assert not keys[:, :batch.length - real].any()  # padding is zero (finite)

    join(["a"], [5])
    step()
    join(["b"], [9])  # longer than the batch: the old row gets padding
    for _ in range(MIN_HEADROOM + 3):  # past a growth
        step()
    join(["c", "d", "e"], [2, 6, 1])  # prefilled together, left-padded among themselves
    step()
    check()
    batch.select([2, 0, 4])  # b and d leave; the columns only b used are cut
    order[:] = ["c", "a", "e"]
    step()
    check()
    assert batch.length == max(int(batch.mask[i].sum()) for i in range(3))
    batch.select([])
    assert len(batch) == 0 and batch.cache is None
