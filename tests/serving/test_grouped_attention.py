"""sdpa without copying grouped key/value heads: the same logits as transformers' sdpa."""

from __future__ import annotations

import copy

import torch

from serving.engine.flat_kv import FlatKVBatch
from serving.engine.grouped_attention import GROUPED_SDPA, use_grouped_sdpa


def test_grouped_sdpa_gives_sdpa_logits_on_a_padded_batch(model):
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the grouped case
    grouped = copy.deepcopy(model)
    assert use_grouped_sdpa(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    assert model.config._attn_implementation == "sdpa"  # only the model asked about changes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row
    with torch.inference_mode():
        want, got = model(input_ids=ids, attention_mask=mask).logits, grouped(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(want[mask.bool()], got[mask.bool()], atol=1e-5)


def test_grouped_sdpa_is_causal_where_transformers_leaves_the_mask_out(model):
    grouped = copy.deepcopy(model)
    use_grouped_sdpa(grouped)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # no padding, no mask: the kernel applies causality
        want, got = model(input_ids=ids).logits, grouped(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5)


def test_grouped_sdpa_gives_sdpa_logits_on_a_flat_step(model):
    grouped = copy.deepcopy(model)
    use_grouped_sdpa(grouped)
    outs = []
    for m in (model, grouped):
        batch = FlatKVBatch()
        step = batch.step([], [[1, 2, 3], [4, 5, 6, 7, 8]], torch.float32)
        with torch.inference_mode():
            outs.append(m(input_ids=step.input_ids, attention_mask=step.mask, position_ids=step.position_ids,
                          logits_to_keep=step.last).logits[0])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_other_attention_implementations_are_left_alone(model):
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert not use_grouped_sdpa(eager) and eager.config._attn_implementation == "eager"
