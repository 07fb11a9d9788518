"""What only the vLLM engine has to get right: a checkpoint with tied embeddings that also stores
``lm_head.weight`` (some exporters write both; ``save_pretrained`` writes only the embedding).

vLLM loads such a checkpoint by skipping the tied twin, so the engine must take a published state
dict with either or both names, as the native engine does (``complete_state_dict``). The engine
contract (test_engine_contract.py) runs the common checkpoint without the head.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from online_sao.config import ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from tests.fixtures.engine_reference import collect, replay_logprobs
from tests.serving.test_engine_contract import LOGPROB_TOL, VLLM_KV_CACHE_BYTES, VLLM_MEMORY_SHARE

pytestmark = pytest.mark.vllm

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def tied_with_head_dir(contract_model_dir, tmp_path_factory) -> Path:
    """The contract model (tied embeddings), its checkpoint storing the head beside the embedding."""
    out = tmp_path_factory.mktemp("tied-with-head")
    shutil.copytree(contract_model_dir, out, dirs_exist_ok=True)
    state = load_file(out / "model.safetensors")
    assert HEAD not in state
    state[HEAD] = state[EMBED].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def engine(tied_with_head_dir):
    from serving.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(tied_with_head_dir, ServingConfig(max_batch_size=2), max_model_len=128, enforce_eager=True,
                        seed=0, gpu_memory_utilization=VLLM_MEMORY_SHARE, kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)
    yield engine
    engine.close()


def test_a_tied_checkpoint_that_also_stores_the_head_is_hot_swapped(engine, tied_with_head_dir):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(tied_with_head_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    state = {k: v.clone() for k, v in other.state_dict().items()}
    assert {EMBED, HEAD} <= state.keys()
    prompt = [5, 6, 7]

    def sample(i):
        req = GenerationRequest(f"tied-{i}", prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8))

        async def main():
            await engine.start()
            try:
                return await asyncio.wait_for(collect(engine, req), 60)
            finally:
                await engine.stop()

        return asyncio.run(main())

    complete = engine.swap_weights(1, state)
    assert complete.applied, complete.reason
    events = sample(1)
    assert {e.version for e in events} == {1}
    assert max(abs(e.logprob - x) for e, x in zip(events, replay_logprobs({1: other}, prompt, events, 0.8, 0.9))) \
        < LOGPROB_TOL
    only_head = {k: v for k, v in state.items() if k != EMBED}  # the embedding is taken from its twin
    assert engine.swap_weights(2, only_head).applied
    events = sample(2)
    assert max(abs(e.logprob - x) for e, x in zip(events, replay_logprobs({2: other}, prompt, events, 0.8, 0.9))) \
        < LOGPROB_TOL
