"""The torch engine refuses at construction a model it would not serve with the model's own
distribution (serving/engine/self_check.py): windowed attention in the flat layout, a model its
cache handling cannot run, a model whose served log-probs differ from a plain forward."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from transformers import (Gemma2Config, GPTNeoConfig, GPTNeoForCausalLM, MambaConfig, MambaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config)

from online_sao.config import ConfigError, ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.self_check import windowed_attention
from serving.engine.torch_engine import TorchEngine
from tests.fixtures.engine_reference import collect, reference_logprob

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
WINDOW = 4
"""Shorter than the self-check's prompts and than the answers below: the window binds."""
GPT_NEO = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=0)


def tiny_mistral(sliding_window: int | None) -> MistralForCausalLM:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**TINY, sliding_window=sliding_window)).eval()


def serve(engine: TorchEngine, prompt: list[int], tokens: int):
    async def main():
        await engine.start()
        try:
            return await collect(engine, GenerationRequest("r", prompt, SamplingParams(max_tokens=tokens, seed=3)))
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_flat_refuses_a_sliding_window_model_that_padded_serves_with_its_own_distribution():
    with pytest.raises(ConfigError, match="sliding_window 4.*serving.kv_layout: padded") as refused:
        TorchEngine(tiny_mistral(WINDOW), cfg=ServingConfig(kv_layout="flat"))
    assert "MistralForCausalLM" in str(refused.value) and "'mistral'" in str(refused.value)

    model = tiny_mistral(WINDOW)
    prompt = [5, 9, 2, 7, 1, 3]
    events = serve(TorchEngine(model, cfg=ServingConfig(kv_layout="padded")), prompt, 20)
    assert len(events) == 20  # past the window of 4, and the zip below checks every one of them
    ids = torch.tensor([prompt + [e.token_id for e in events]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # the model's own window mask
    for z, event in zip(logits, events):
        assert event.logprob == pytest.approx(reference_logprob(z, event.token_id, 1.0, 1.0), abs=1e-4)


def test_flat_refuses_gpt_neo_whose_attention_masks_with_a_buffer_of_its_own():
    """GPT-Neo's local layers were not seen as windowed, and its mask, a buffer of max_position_embeddings
    columns, ignores the flat layout's: served flat, log-probs 0.35 nats off, then 500s once a row outgrew it.
    A GPT-Neo of global layers alone masks with that buffer too."""
    torch.manual_seed(0)
    model = GPTNeoForCausalLM(GPTNeoConfig(**GPT_NEO, attention_types=[[["global"], 2]])).eval()
    with pytest.raises(ConfigError, match="buffer of max_position_embeddings columns.*serving.kv_layout: padded"):
        TorchEngine(model, cfg=ServingConfig(kv_layout="flat"))
    TorchEngine(model, cfg=ServingConfig(kv_layout="padded"))


def test_a_model_without_a_window_is_served_in_either_layout():
    for layout in ("padded", "flat"):
        TorchEngine(tiny_mistral(None), cfg=ServingConfig(kv_layout=layout))


@pytest.mark.parametrize("config,windowed", [
    (MistralConfig(**TINY, sliding_window=WINDOW), True),
    (MistralConfig(**TINY, sliding_window=None), False),
    (MistralConfig(**TINY, sliding_window=64), False),  # as long as the model's positions: never binds
    (Qwen2Config(**TINY, use_sliding_window=False, sliding_window=WINDOW), False),
    (Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), True),
    (Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2), False),
    (Gemma2Config(**TINY, head_dim=8, sliding_window=WINDOW), True),  # every other layer
    (GPTNeoConfig(**GPT_NEO, attention_types=[[["global", "local"], 1]], window_size=WINDOW), True),
    (GPTNeoConfig(**GPT_NEO, attention_types=[[["global"], 2]]), False),
], ids=["mistral", "mistral-none", "mistral-long", "qwen2-off", "qwen2-upper-layer", "qwen2-no-layer", "gemma2",
        "gpt-neo-local", "gpt-neo-global"])
def test_which_configs_have_windowed_attention(config, windowed):
    assert (windowed_attention(config) is not None) == windowed


@pytest.mark.parametrize("kv_layout", ["padded", "flat"])
def test_a_model_the_cache_handling_cannot_run_is_refused_at_construction(kv_layout, caplog):
    torch.manual_seed(0)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)).eval()
    with pytest.raises(ConfigError, match=f"MambaForCausalLM.*'mamba'.*serving.kv_layout: {kv_layout}.*self-check"
                                          ".*failed with IndexError"):
        TorchEngine(mamba, cfg=ServingConfig(kv_layout=kv_layout))
    # the refusal says what failed: no ERROR and traceback of the failed step before it, which read as a crash
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def skewed_when_masked(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` whose logits move whenever it gets an attention mask: the engine always passes one,
    a plain forward of one sequence none (a stand-in for cache or mask handling that does not fit)."""
    forward = model.forward
    skew = torch.linspace(-2.0, 2.0, model.config.vocab_size)

    @functools.wraps(forward)  # the engine reads the signature (logits_to_keep, the cache's name)
    def skewed(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("attention_mask") is not None:
            out.logits = out.logits + skew
        return out

    model.forward = skewed
    return model


@pytest.mark.parametrize("kv_layout", ["padded", "flat"])
def test_a_model_served_otherwise_than_its_plain_forward_is_refused_at_construction(kv_layout):
    with pytest.raises(ConfigError, match=f"MistralForCausalLM.*serving.kv_layout: {kv_layout}.*differ by up to"):
        TorchEngine(skewed_when_masked(tiny_mistral(None)), cfg=ServingConfig(kv_layout=kv_layout))


def test_the_check_reports_no_steps_and_leaves_the_engine_ready_to_start():
    steps = []
    engine = TorchEngine(tiny_mistral(None), cfg=ServingConfig(kv_layout="flat"), on_step=steps.append)
    assert steps == [] and engine.running == 0 and engine.waiting == 0
    assert len(serve(engine, [1, 2, 3], 5)) == 5 and steps
