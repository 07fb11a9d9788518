"""Tiny causal LMs (random weights, no tokenizer) for the algorithm tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 64


def make_tiny_qwen(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(config)


@pytest.fixture
def tiny_qwen() -> Qwen2ForCausalLM:
    return make_tiny_qwen()


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config)


@pytest.fixture
def snapshot_weights():
    """``check = snapshot_weights(*models)`` copies every parameter; ``check()`` then
    asserts bit-for-bit that none changed (NaN equal to NaN)."""

    def take(*models):
        before = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]

        def check() -> None:
            for snap, model in zip(before, models):
                for name, param in model.named_parameters():
                    torch.testing.assert_close(param, snap[name], rtol=0, atol=0, equal_nan=True, msg=name)

        return check

    return take
