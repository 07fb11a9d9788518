"""What every inference engine promises, run against each engine behind the seam.

The native engine runs in the default run; the vLLM engine only in the vLLM lane
(``make test-vllm``, marker ``vllm``), where a vLLM that does not import is an
error, not a skip. The promises: behaviour log-probs under the exact sampling
distribution (temperature and top-p), equal to the learner's own log-probs of the
logged record at the same weights, stop tokens, and a hot-swap with requests in
flight that stamps every token with the version that sampled it.

vLLM's CPU attention kernels need a head size of at least 32, so the model is a
random-weight Qwen2 of that shape with the tiny fixture's tokenizer.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
from pathlib import Path

import pytest
import torch

from online_sao.config import ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import TorchEngine
from serving.trajectories import TrajectoryPrefix
from tests.fixtures.engine_reference import (collect, learner_logprobs, record_of, reference_logprob, replay_logits,
                                             replay_logprobs)

LOGPROB_TOL = 2e-4
"""Float32 engine kernels (vLLM's CPU ones, or batched torch) vs a float64 one-at-a-time reference."""
TEMPERATURE, TOP_P = 0.8, 0.9
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [42], [7, 7, 7, 7]]
SWAP_TOKENS = 48
"""Tokens per request in the swap test: long enough that the swap lands while they decode."""
VLLM_MEMORY_SHARE = 0.05
"""Share of the machine's memory vLLM may claim (on a CPU its default 0.92 refuses to start
whenever other processes hold more than 8%)."""
VLLM_KV_CACHE_BYTES = 64 * 2**20
"""KV cache of the test engine: 8 sequences of 128 tokens need well under 1 MiB at this size."""
ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module")
def contract_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("contract-model")
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
def versions(contract_model_dir) -> dict[int, torch.nn.Module]:
    """Version 0 is the saved model; version 1 a perturbed copy."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(contract_model_dir, dtype=torch.float32).eval()
    other = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return {0: base, 1: other}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, contract_model_dir):
    cfg = ServingConfig(max_batch_size=8)
    if request.param == "torch":
        yield TorchEngine.from_pretrained(contract_model_dir, cfg)
        return
    from serving.engine.vllm_engine import VLLMEngine  # raises where vLLM does not import: the lane fails

    engine = VLLMEngine(contract_model_dir, cfg, max_model_len=128, enforce_eager=True, seed=0,
                        gpu_memory_utilization=VLLM_MEMORY_SHARE, kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)
    yield engine
    engine.close()


def request(i, prompt, **sampling):
    params = {"temperature": TEMPERATURE, "top_p": TOP_P, "seed": i, "max_tokens": 12, **sampling}
    return GenerationRequest(f"r{i}-{id(sampling)}", prompt, SamplingParams(**params))


def worst_error(events, expected) -> float:
    return max(abs(e.logprob - x) for e, x in zip(events, expected))


def test_logprobs_are_the_processed_ones_under_the_sampling_distribution(engine, versions):
    requests = [request(i, p) for i, p in enumerate(PROMPTS)]

    async def main():
        await engine.start()
        out = await asyncio.gather(*(collect(engine, r) for r in requests))
        await engine.stop()
        return out

    results = asyncio.run(main())
    for req, events in zip(requests, results):
        assert len(events) == 12 and events[-1].finish_reason == "length"
        assert {e.version for e in events} == {engine.policy_version}
        expected = replay_logprobs({engine.policy_version: versions[0]}, req.prompt_ids, events, TEMPERATURE, TOP_P)
        assert worst_error(events, expected) < LOGPROB_TOL
    # the reference tells distributions apart: the same tokens at temperature 1 and no top-p disagree
    plain = [replay_logprobs({0: versions[0]}, r.prompt_ids, ev, 1.0, 1.0) for r, ev in zip(requests, results)]
    assert max(worst_error(ev, xs) for ev, xs in zip(results, plain)) > 100 * LOGPROB_TOL


def test_top_logprobs_are_the_most_likely_tokens_under_the_sampling_distribution(engine, versions):
    count = 5
    req = GenerationRequest("top", PROMPTS[1], SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=3,
                                                              max_tokens=8), top_logprobs=count)

    async def main():
        await engine.start()
        out = await collect(engine, req)
        await engine.stop()
        return out

    events = asyncio.run(main())
    logits = replay_logits({engine.policy_version: versions[0]}, req.prompt_ids, events)
    for event, z in zip(events, logits):
        reference = [reference_logprob(z, t, TEMPERATURE, TOP_P) for t in range(z.shape[0])]
        finite = sorted((lp for lp in reference if lp > float("-inf")), reverse=True)
        assert 1 <= len(event.top_logprobs) == min(count, len(finite))
        assert [lp for _, lp in event.top_logprobs] == pytest.approx(finite[:count], abs=LOGPROB_TOL)
        for token, logprob in event.top_logprobs:
            assert abs(logprob - reference[token]) < LOGPROB_TOL
        if event.token_id in dict(event.top_logprobs):
            assert dict(event.top_logprobs)[event.token_id] == pytest.approx(event.logprob, abs=LOGPROB_TOL)


def test_the_learners_logprobs_of_the_logged_record_are_the_engines(engine, versions):
    """The learner's own path (record -> rollout -> batch -> policy_logprobs) at the serving
    weights gives back the engine's behaviour log-probs, so the importance ratio is 1 at zero lag,
    for every temperature and top-p: the nucleus the learner cuts is the one the engine drew from."""
    settings = [(t, p) for t in (0.7, 1.0, 1.3) for p in (1.0, 0.9, 0.5)]
    cases = [(t, p, prompt) for t, p in settings for prompt in PROMPTS]
    requests = [request(100 + k, prompt, temperature=t, top_p=p) for k, (t, p, prompt) in enumerate(cases)]

    async def main():
        await engine.start()
        out = await asyncio.gather(*(collect(engine, r) for r in requests))
        await engine.stop()
        return out

    policy = versions[engine.policy_version]
    worst: dict[tuple[float, float], float] = {}
    for req, events in zip(requests, asyncio.run(main())):
        record = record_of(TrajectoryPrefix(list(req.prompt_ids)), req, events)
        learned = learner_logprobs(policy, record)
        key = (req.sampling.temperature, req.sampling.top_p)
        worst[key] = max(worst.get(key, 0.0), worst_error(events, learned))
    assert set(worst) == set(settings)
    assert max(worst.values()) < LOGPROB_TOL, worst


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


def test_weights_swap_with_requests_in_flight_and_refusals(engine, versions):
    start_version = engine.policy_version
    state = {k: v.clone() for k, v in versions[1].state_dict().items()}
    bad = dict(state, **{"model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))})
    refused = engine.swap_weights(start_version + 1, bad)
    assert not refused.applied and "non-finite" in refused.reason
    requests = [request(10 + i, p, max_tokens=SWAP_TOKENS) for i, p in enumerate(PROMPTS)]
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
        swap = await asyncio.to_thread(engine.swap_weights, start_version + 1, state)
        out = await asyncio.gather(*streams)
        await engine.stop()
        return swap, out

    swap, results = asyncio.run(main())
    new_version = start_version + 1
    assert swap.applied and engine.policy_version == new_version
    assert not engine.swap_weights(start_version, state).applied  # older: ignored
    mixed = 0
    models = {start_version: versions[0], new_version: versions[1]}
    for req, events in zip(requests, results):
        seen = [e.version for e in events]
        assert seen == sorted(seen) and set(seen) <= set(models) and len(events) == SWAP_TOKENS
        mixed += seen[0] == start_version and seen[-1] == new_version
        assert worst_error(events, replay_logprobs(models, req.prompt_ids, events, TEMPERATURE, TOP_P)) < LOGPROB_TOL
    assert mixed >= 1  # at least one request was in flight across the switch
