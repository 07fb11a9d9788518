"""The running batch's left-padded KV cache: in-place growth, joining and leaving rows."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from serving.engine.kv_batch import MIN_HEADROOM, GrowingLayer, RaggedKVBatch

HEADS, DIM, LAYERS = 2, 4, 3


def prefilled(length: int, seed: int) -> tuple[DynamicCache, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A cache as a prefill of ``length`` tokens leaves it, and its per-layer (keys, values) ``[1, H, length, D]``."""
    g = torch.Generator().manual_seed(seed)
    cache, kv = DynamicCache(), []
    for layer in range(LAYERS):
        k, v = torch.randn(1, HEADS, length, DIM, generator=g), torch.randn(1, HEADS, length, DIM, generator=g)
        cache.update(k, v, layer)
        kv.append((k, v))
    return cache, kv


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

    def join(name: str, length: int) -> None:
        cache, kv = prefilled(length, seed=len(rows))
        batch.append(cache, length)
        rows[name] = [[k[0]] for k, _ in kv]
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

    join("a", 5)
    step()
    join("b", 9)  # longer than the batch: the old row gets padding
    for _ in range(MIN_HEADROOM + 3):  # past a growth
        step()
    join("c", 2)
    step()
    check()
    batch.select([2, 0])  # b leaves; the columns only b used are cut
    order[:] = ["c", "a"]
    step()
    check()
    assert batch.length == max(int(batch.mask[i].sum()) for i in range(2))
    batch.select([])
    assert len(batch) == 0 and batch.cache is None
