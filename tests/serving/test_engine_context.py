"""The context a model is served with (serving/engine/self_check.py, ``served_context_length``): the text
config's positions (a composite config keeps them in ``text_config``), and for longrope rope scaling only the
original ones, whose rope factors no batch changes. The torch engine and the HTTP layer apply the same limit."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, LlamaConfig, Phi3Config, Phi3ForCausalLM

from online_sao.config import ServingConfig
from online_sao.sampling import nucleus_logprobs
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import TorchEngine
from serving.server import build_stack
from streams.memory import InMemoryBackend
from tests.fixtures.engine_reference import collect
from tests.serving.conftest import serving_config
from tests.serving.fakes import FakeEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ORIGINAL, EXTENDED = 32, 256
"""The tiny Phi3's original positions and those its longrope scaling extends them to."""
TEXT_POSITIONS = 64
"""The tiny Gemma3's text positions (its top-level config has none)."""
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def longrope_config() -> Phi3Config:
    """Phi-3's long-context scaling: short factors within ``ORIGINAL`` positions, long ones (8x) past it."""
    return Phi3Config(**TINY, max_position_embeddings=EXTENDED, original_max_position_embeddings=ORIGINAL,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                       "long_factor": [8.0] * 4, "original_max_position_embeddings": ORIGINAL},
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=None)


def composite_config() -> Gemma3Config:
    """Gemma3 as ``AutoModelForCausalLM`` loads it: ...ForConditionalGeneration, its positions in text_config."""
    return Gemma3Config(text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=TEXT_POSITIONS, sliding_window=16,
                                         layer_types=["sliding_attention", "full_attention"]),
                        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=16),
                        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)


def served(engine: TorchEngine, *requests: GenerationRequest):
    """Each request's events, or the exception that refused it, the requests served together."""
    async def main():
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, r) for r in requests), return_exceptions=True)
        finally:
            await engine.stop()

    return asyncio.run(main())


def request(name: str, prompt_len: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(name, [3 + i % 100 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens,
                                                                                              seed=len(name)))


def test_the_served_context_is_the_text_configs_and_a_longrope_models_original_one(caplog):
    from serving.engine.self_check import served_context_length  # here: the tests below run without it

    assert served_context_length(LlamaConfig(**TINY, max_position_embeddings=EXTENDED)) == EXTENDED
    assert served_context_length(Phi3Config(**TINY, max_position_embeddings=EXTENDED)) == EXTENDED  # no scaling
    assert served_context_length(composite_config()) == TEXT_POSITIONS
    with caplog.at_level(logging.WARNING, logger="serving.engine.self_check"):
        assert served_context_length(longrope_config()) == ORIGINAL
    assert "longrope" in caplog.text and f"original {ORIGINAL} positions, not {EXTENDED}" in caplog.text


@pytest.mark.parametrize("kv_layout", ["padded", "flat"])
def test_a_longrope_model_is_served_within_its_original_positions_as_a_plain_forward_computes_it(kv_layout):
    torch.manual_seed(0)
    model = Phi3ForCausalLM(longrope_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a random tiny model's near-uniform outputs hide a rope difference
    engine = TorchEngine(model, cfg=ServingConfig(kv_layout=kv_layout, max_batch_size=4))
    past_the_original, crossing = served(engine, request("long", ORIGINAL + 8, 8), request("crossing", 25, 20))
    assert isinstance(past_the_original, ValueError) and "no room" in str(past_the_original)
    # cut at the original context: the long factors, which a plain forward of a longer sequence would use
    # for every one of its tokens, never apply to any token logged
    assert len(crossing) == ORIGINAL - 25 and crossing[-1].finish_reason == "length"
    prompt = request("crossing", 25, 20).prompt_ids
    ids = torch.tensor([prompt + [e.token_id for e in crossing[:-1]]])
    with torch.inference_mode():
        logp = nucleus_logprobs(model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:], 1.0, 1.0)
    for position, event in enumerate(crossing):
        assert event.logprob == pytest.approx(float(logp[position, event.token_id]), abs=1e-4)


def test_a_prompt_over_a_composite_models_text_context_is_refused_by_the_engine():
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(composite_config()).eval()
    engine = TorchEngine(model, cfg=ServingConfig(kv_layout="padded"))
    over, near_the_end = served(engine, request("over", TEXT_POSITIONS, 5), request("near", TEXT_POSITIONS - 3, 20))
    assert isinstance(over, ValueError) and f"{TEXT_POSITIONS} positions" in str(over)
    assert len(near_the_end) == 3 and near_the_end[-1].finish_reason == "length"


def test_the_server_refuses_a_prompt_over_a_composite_models_text_context(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir, ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    composite_config().save_pretrained(model_dir)
    cfg = serving_config(tmp_path)
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    stack = build_stack(cfg, model_dir, backend, engine=FakeEngine([5, 6, 7]))
    with TestClient(stack.app, raise_server_exceptions=False) as client:
        over = client.post("/v1/completions", json={"model": cfg.serving.model_name, "prompt": [5] * TEXT_POSITIONS})
        within = client.post("/v1/completions", json={"model": cfg.serving.model_name, "prompt": [5] * 10,
                                                       "max_tokens": 3})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert within.status_code == 200
