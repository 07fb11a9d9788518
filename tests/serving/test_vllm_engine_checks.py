"""What only the vLLM engine has to get right: a checkpoint with tied embeddings that also stores
``lm_head.weight`` (some exporters write both; ``save_pretrained`` writes only the embedding), one whose
config.json leaves the tie to its config class's default, the engine seed of unseeded requests, and
engine arguments the engine sets itself.

vLLM loads such a checkpoint by skipping the tied twin, so the engine must take a published state
dict with either or both names, as the native engine does (``complete_state_dict``). The engine
contract (test_engine_contract.py) runs the common checkpoint without the head.
"""

from __future__ import annotations

import asyncio
import json
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
UNSEEDED_TOKENS = 12
"""Tokens of the unseeded request two engines draw: at temperature 2 on this model two engines with
different seeds drawing the same twelve tokens would take extraordinary luck."""


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


@pytest.fixture(scope="module")
def implicitly_tied_dir(contract_model_dir, tmp_path_factory) -> Path:
    """A tiny OPT (its config class ties the embeddings by default) with the contract model's tokenizer,
    its config.json without ``tie_word_embeddings``, as gpt2's, OPT's and Gemma's checkpoints have it."""
    from transformers import OPTConfig, OPTForCausalLM

    out = tmp_path_factory.mktemp("implicitly-tied")
    vocab = json.loads((contract_model_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                     num_attention_heads=2, word_embed_proj_dim=64, max_position_embeddings=256,
                                     dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():  # sharper than a fresh init, so that a stale head shows
        model.get_input_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (out / "config.json").write_text(json.dumps(config))
    for f in contract_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def perturbed(model_dir: Path) -> torch.nn.Module:
    """The model of ``model_dir`` with every weight moved: a new version to swap in."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return other


def served(engine, req: GenerationRequest):
    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(collect(engine, req), 60)
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_a_checkpoint_tied_by_its_config_class_default_is_hot_swapped(implicitly_tied_dir):
    """The engine read the tie from config.json's key alone: without it vLLM's packed CPU head kept the
    old weights after a swap, and the log-probs came from a mix of old and new weights (1.1 nats off)."""
    from serving.engine.vllm_engine import VLLMEngine

    assert "tie_word_embeddings" not in json.loads((implicitly_tied_dir / "config.json").read_text())
    engine = VLLMEngine(implicitly_tied_dir, ServingConfig(max_batch_size=2), max_model_len=128,
                        enforce_eager=True, seed=0, gpu_memory_utilization=VLLM_MEMORY_SHARE,
                        kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)
    try:
        other = perturbed(implicitly_tied_dir)
        assert engine.swap_weights(1, {k: v.clone() for k, v in other.state_dict().items()}).applied
        prompt = [5, 6, 7]
        events = served(engine, GenerationRequest("implicit", prompt, SamplingParams(temperature=0.8, top_p=1.0,
                                                                                     seed=3, max_tokens=8)))
    finally:
        engine.close()
    assert {e.version for e in events} == {1}
    expected = replay_logprobs({1: other}, prompt, events, 0.8, 1.0)
    assert max(abs(e.logprob - x) for e, x in zip(events, expected)) < LOGPROB_TOL


def test_engines_built_without_a_seed_draw_unseeded_requests_differently(contract_model_dir):
    """vLLM's default engine seed (0) drew every unseeded request alike after each restart and on
    every replica; the native engine seeds each one afresh."""
    from serving.engine.vllm_engine import VLLMEngine

    draws = []
    for i in range(2):
        engine = VLLMEngine(contract_model_dir, ServingConfig(max_batch_size=2, vllm_self_check=False),
                            max_model_len=128, enforce_eager=True, gpu_memory_utilization=VLLM_MEMORY_SHARE,
                            kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)
        try:
            req = GenerationRequest(f"unseeded-{i}", [3, 40, 90, 200] * 5,
                                    SamplingParams(temperature=2.0, max_tokens=UNSEEDED_TOKENS))
            draws.append([e.token_id for e in served(engine, req)])
        finally:
            engine.close()
    assert len(draws[0]) == len(draws[1]) == UNSEEDED_TOKENS
    assert draws[0] != draws[1]


def test_an_engine_argument_the_engine_sets_is_refused_naming_it(contract_model_dir):
    """Such an argument failed vLLM's constructor with "got multiple values for keyword argument"."""
    from serving.engine.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match=r"sets max_num_seqs itself \(2: serving\.max_batch_size\), 4 was given"):
        VLLMEngine(contract_model_dir, ServingConfig(max_batch_size=2), max_num_seqs=4)


def test_a_tied_checkpoint_that_also_stores_the_head_is_hot_swapped(engine, tied_with_head_dir):
    other = perturbed(tied_with_head_dir)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    assert {EMBED, HEAD} <= state.keys()
    prompt = [5, 6, 7]

    def sample(i):
        return served(engine, GenerationRequest(f"tied-{i}", prompt, SamplingParams(temperature=0.8, top_p=0.9,
                                                                                     seed=i, max_tokens=8)))

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
