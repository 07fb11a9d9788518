"""The vLLM engine refuses at construction a model it serves otherwise than the transformers model the
learner loads (serving/engine/vllm_self_check.py): vLLM has its own implementation of each architecture.

The engine's real vLLM path runs; what differs is the reference: a perturbed copy of the weights stands
for an architecture vLLM implements otherwise (the learner's log-probs would not be the logged ones).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from online_sao.config import ConfigError, ServingConfig
from online_sao.modeling import load_policy
from online_sao.schemas import SamplingParams
from serving.engine import vllm_self_check
from serving.engine.base import GenerationRequest
from tests.fixtures.engine_reference import collect, replay_logprobs
from tests.serving.test_engine_contract import LOGPROB_TOL, VLLM_KV_CACHE_BYTES, VLLM_MEMORY_SHARE

pytestmark = pytest.mark.vllm

PERTURBATION = 0.05
"""Weight noise of the stand-in for a differing implementation: tenths of a nat on the contract model."""


def vllm_engine(model_dir, **serving):
    from serving.engine.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, ServingConfig(max_batch_size=2, **serving), max_model_len=128, enforce_eager=True,
                      seed=0, gpu_memory_utilization=VLLM_MEMORY_SHARE, kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)


def perturbed(model_dir, dtype):
    model = load_policy(model_dir, dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(PERTURBATION * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture
def loads(monkeypatch):
    """The reference loads of the check, as ``(model_dir, dtype)``."""
    calls = []

    def spy(model_dir, dtype):
        calls.append((model_dir, dtype))
        return load_policy(model_dir, dtype)

    monkeypatch.setattr(vllm_self_check, "load_policy", spy)
    return calls


def test_the_check_passes_on_the_contract_model_and_leaves_the_engine_ready(contract_model_dir, loads, caplog):
    with caplog.at_level(logging.INFO, logger=vllm_self_check.__name__):
        engine = vllm_engine(contract_model_dir)
    try:
        assert loads == [(contract_model_dir, "float32")]
        assert any("Qwen2ForCausalLM (model_type 'qwen2') in the vLLM engine agrees" in r.getMessage()
                   for r in caplog.records)
        prompt = [5, 6, 7]  # the check's requests are gone: a request served now is the model's own
        reference = load_policy(contract_model_dir).eval()

        async def main():
            await engine.start()
            try:
                return await asyncio.wait_for(collect(engine, GenerationRequest(
                    "after-check", prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=6))), 60)
            finally:
                await engine.stop()

        events = asyncio.run(main())
        assert len(events) == 6 and {e.version for e in events} == {0}
        expected = replay_logprobs({0: reference}, prompt, events, 0.8, 0.9)
        assert max(abs(e.logprob - x) for e, x in zip(events, expected)) < LOGPROB_TOL
    finally:
        engine.close()


def test_a_model_vllm_serves_otherwise_than_the_learners_is_refused(contract_model_dir, monkeypatch):
    monkeypatch.setattr(vllm_self_check, "load_policy", perturbed)
    with pytest.raises(ConfigError, match=r"Qwen2ForCausalLM \(model_type 'qwen2'\) served by the vLLM engine "
                                          r"samples from another distribution.*differ by up to (\d|0\.[1-9])"):
        vllm_engine(contract_model_dir)


def test_an_exception_in_the_check_refuses_the_model_and_shuts_vllm_down(contract_model_dir, monkeypatch):
    from serving.engine.vllm_engine import VLLMEngine

    def cannot_load(model_dir, dtype):
        raise ValueError("Unrecognized configuration class")

    closed = []
    close = VLLMEngine.close
    monkeypatch.setattr(VLLMEngine, "close", lambda self: (closed.append(self), close(self)))
    monkeypatch.setattr(vllm_self_check, "load_policy", cannot_load)
    with pytest.raises(ConfigError, match=r"Qwen2ForCausalLM \(model_type 'qwen2'\) cannot be served by the vLLM "
                                          r"engine: its self-check .* failed with ValueError: Unrecognized"):
        vllm_engine(contract_model_dir)
    assert len(closed) == 1  # its engine core and worker do not outlive the refusal


def test_the_check_can_be_turned_off(contract_model_dir, monkeypatch):
    monkeypatch.setattr(vllm_self_check, "load_policy", perturbed)
    vllm_engine(contract_model_dir, vllm_self_check=False).close()  # a perturbed reference is never loaded
