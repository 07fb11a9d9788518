"""The flat KV layout: one cache row for every sequence, prompts prefilled inside the decode forward."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from serving.engine.flat_kv import COMPACT_SHARE, DEAD, FlatKVBatch

LOGIT_TOL = 1e-4
"""float32 attention over a differently arranged cache against a forward of each sequence alone."""


def forward(model, batch: FlatKVBatch, last_tokens: list[int], prompts: list[list[int]]) -> torch.Tensor:
    """One flat step as the engine runs it: ``[rows + prompts, V]`` next-token logits."""
    step = batch.step(last_tokens, prompts, torch.float32)
    cache = batch.cache if batch.cache is not None else DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=step.input_ids, attention_mask=step.mask, position_ids=step.position_ids,
                    cache=cache, use_cache=True, logits_to_keep=step.last)
    batch.commit(step, cache)
    return out.logits[0]


def alone(model, tokens: list[int]) -> torch.Tensor:
    """The reference: next-token logits of ``tokens`` in a forward of their own, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def test_each_row_gets_the_logits_of_its_own_sequence_alone_through_joins_leaves_and_compaction(model):
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    batch = FlatKVBatch()
    running: list[list[int]] = []  # each row's tokens so far, in row order
    # (prompts joining at this round, rows leaving after it): joins into a running batch, several
    # at once, leaves from the middle and the ends, and enough dead columns to compact
    plan = [([[1, 2, 3]], []), ([], []), ([[5, 6, 7, 8, 9], [42]], []), ([], [1]), ([[7, 7]], []),
            ([], [0, 2]), ([], []), ([[11, 12, 13, 14, 15, 16]], []), ([], [0]), ([], [])]
    compactions = 0
    for prompts, leaving in plan:
        last = [seq[-1] for seq in running]
        width_before = batch.width
        logits = forward(model, batch, last, prompts)
        running = [seq for seq in running] + [list(p) for p in prompts]
        for row, seq in enumerate(running):
            assert torch.allclose(logits[row], alone(model, seq), atol=LOGIT_TOL), (row, seq)
        # every row samples a token; the leaving ones go
        for seq in running:
            seq.append(int(torch.randint(3, vocab, (1,), generator=g)))
        keep = [i for i in range(len(running)) if i not in leaving]
        batch.select(keep)
        running = [running[i] for i in keep]
        compactions += batch.width < width_before + len(last) + sum(map(len, prompts))
        assert batch.lengths == [len(seq) - 1 for seq in running]  # the newest token is not cached yet
    assert compactions >= 1


def test_leaving_rows_die_and_the_row_compacts_at_the_threshold(model):
    batch = FlatKVBatch()
    forward(model, batch, [], [[1, 2, 3, 4], [5, 6], [7, 8]])  # 8 columns, owners 0 0 0 0 1 1 2 2
    batch.select([1, 2])  # owner 0 leaves: 4 of 8 dead, the threshold
    assert 4 >= COMPACT_SHARE * 8
    assert batch.width == 4 and batch.rows == [1, 2] and batch.lengths == [2, 2]
    assert batch.cache.layers[0].keys.shape[2] == 4

    batch.select([1])  # owner 2 leaves: 2 of 4 dead, compacted again
    assert batch.width == 2 and batch.rows == [2]
    forward(model, batch, [9], [[3, 4, 5]])  # 2 + 1 + 3 = 6 columns
    batch.select([1])  # owner 2 leaves: 3 of 6 dead
    assert batch.width == 3 and batch.rows == [3]


def test_a_row_below_the_threshold_leaves_its_columns_dead_in_place(model):
    batch = FlatKVBatch()
    forward(model, batch, [], [[1], [2, 3, 4, 5, 6]])
    batch.select([1])  # 1 of 6 columns dead: under the threshold, no copy
    assert batch.width == 6 and batch.rows == [1]
    assert batch._owners[:6].tolist() == [DEAD, 1, 1, 1, 1, 1]


def test_a_step_needs_one_last_token_per_running_row(model):
    batch = FlatKVBatch()
    forward(model, batch, [], [[1, 2]])
    with pytest.raises(ValueError, match="1 running rows"):
        batch.step([], [[3]], torch.float32)


def test_a_failed_forward_leaves_the_committed_columns_only(model):
    batch = FlatKVBatch()
    forward(model, batch, [], [[1, 2, 3]])
    step = batch.step([4], [[5, 6]], torch.float32)
    first = batch.cache.layers[0]
    _, heads, _, dim = first.keys.shape
    first.update(torch.zeros(1, heads, 3, dim), torch.zeros(1, heads, 3, dim))  # a forward that got one layer in
    batch.discard()
    assert all(layer.keys.shape[2] == 3 for layer in batch.cache.layers)
    assert step.mask.shape == (1, 1, 3, 6)
    logits = forward(model, batch, [4], [[5, 6]])  # the same step again, now whole
    assert torch.allclose(logits[0], alone(model, [1, 2, 3, 4]), atol=LOGIT_TOL)
