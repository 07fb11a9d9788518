"""What a failure in the vLLM engine's step may take down: only the requests it concerns.

- A seeded request whose prompt is longer than the step's token budget: on the CPU build vLLM's V1
  runner rewinds the seeded generator after a partial (chunked) prefill, which a CPU generator cannot
  do; the step failed, and every request with it. The engine prefills whole prompts on CPU.
- A step that raises fails the requests vLLM was running, not those still in its waiting queue
  (as the native engine fails only its step's rows).
- A request whose step output is not finite fails alone.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from online_sao.config import ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.sampling import NonFiniteLogits
from tests.serving.test_engine_contract import VLLM_KV_CACHE_BYTES, VLLM_MEMORY_SHARE, failing_once

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 256
STEP_BUDGET = 64
"""The step token budget the engine is configured with (``max_num_batched_tokens``): below the context."""
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine(contract_model_dir):
    from serving.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(contract_model_dir, ServingConfig(max_batch_size=2, vllm_self_check=False),
                        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_BUDGET, enforce_eager=True, seed=0,
                        gpu_memory_utilization=VLLM_MEMORY_SHARE, kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)
    yield engine
    engine.close()


def request(rid: str, prompt: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**{"temperature": 0.8, "top_p": 0.9, "seed": None,
                                                            "max_tokens": 12, **sampling}))


async def consume(engine, req: GenerationRequest, started: asyncio.Event | None = None):
    events = []
    async for event in engine.generate(req):
        events.append(event)
        if started is not None:
            started.set()
    return events


def outcomes(results) -> list[str]:
    return [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else f"{len(r)} tokens" for r in results]


def test_a_seeded_prompt_longer_than_the_step_budget_is_served_beside_the_others(engine):
    rng = random.Random(0)
    long_prompt = [rng.randrange(3, engine._vocab) for _ in range(100)]
    assert STEP_BUDGET < len(long_prompt) < MAX_MODEL_LEN

    async def main():
        await engine.start()
        try:
            started = asyncio.Event()
            decoding = asyncio.ensure_future(consume(engine, request("b0", [5, 6, 7], max_tokens=60), started))
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
            seeded = asyncio.ensure_future(consume(engine, request("seeded-long", long_prompt, seed=7, max_tokens=4)))
            waiting = asyncio.ensure_future(consume(engine, request("b1", [8, 9], max_tokens=8)))
            together = await asyncio.wait_for(asyncio.gather(decoding, seeded, waiting, return_exceptions=True),
                                              TIMEOUT_S)
            alone = await asyncio.wait_for(consume(engine, request("seeded-again", long_prompt, seed=7, max_tokens=4)),
                                           TIMEOUT_S)
            return together, alone
        finally:
            await engine.stop()

    together, alone = asyncio.run(main())
    assert outcomes(together) == ["60 tokens", "4 tokens", "8 tokens"]
    # the seeded answer is the seed's, with or without others in the step
    assert [e.token_id for e in together[1]] == [e.token_id for e in alone]


def test_a_failing_step_fails_only_the_requests_vllm_was_running(engine, monkeypatch):
    """max_batch_size 2 and 6 requests: vLLM runs 2 and holds 4 in its waiting queue; a step failure
    fails at most the 2 it ran, and the 4 waiting ones are served in full."""
    armed = failing_once(monkeypatch, engine._llm, "step")
    requests = [request(f"s{i}", [5 + i, 6, 7], max_tokens=20, seed=i) for i in range(6)]

    async def main():
        await engine.start()
        try:
            started = asyncio.Event()
            streams = [asyncio.ensure_future(consume(engine, r, started)) for r in requests]
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
            armed.set()
            return await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), TIMEOUT_S)
        finally:
            await engine.stop()

    results = outcomes(asyncio.run(main()))
    failed = [r for r in results if r != "20 tokens"]
    assert 1 <= len(failed) <= 2 and len(results) - len(failed) >= 4, results
    assert all("injected step failure" in r for r in failed), results


def test_a_non_finite_row_fails_its_request_alone(engine, monkeypatch):
    """One request's step output carries a NaN log-probability: that request fails with
    NonFiniteLogits, the others in the same step go on."""
    from vllm.logprobs import Logprob

    original = engine._llm.step
    armed = threading.Event()

    def step(*args, **kwargs):
        outputs = original(*args, **kwargs)
        for out in outputs:
            completion = out.outputs[0]
            if out.request_id.startswith("nan#") and armed.is_set() and completion.token_ids:
                armed.clear()
                completion.logprobs = [{t: Logprob(logprob=float("nan"), rank=1)} for t in completion.token_ids]
        return outputs

    monkeypatch.setattr(engine._llm, "step", step)

    async def main():
        await engine.start()
        try:
            started = asyncio.Event()
            streams = [asyncio.ensure_future(consume(engine, request(rid, [5, 6, 7], max_tokens=16, seed=1), started))
                       for rid in ("ok", "nan")]
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
            armed.set()
            return await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), TIMEOUT_S)
        finally:
            await engine.stop()

    ok, nan = asyncio.run(main())
    assert isinstance(nan, NonFiniteLogits), outcomes([nan])
    assert not isinstance(ok, BaseException) and len(ok) == 16, outcomes([ok])


def test_a_memory_share_the_host_cannot_give_is_refused_before_vllm_starts(contract_model_dir):
    """All but nothing of the host's memory: vLLM's worker refused it in a traceback naming vLLM's own flag;
    the engine now refuses it first, naming serving.vllm_memory_share."""
    from online_sao.config import ConfigError
    from serving.engine.vllm_engine import VLLMEngine

    with pytest.raises(ConfigError, match=r"^serving\.vllm_memory_share: the vLLM engine on CPU takes 0\.99 "):
        VLLMEngine(contract_model_dir, ServingConfig(max_batch_size=2, vllm_self_check=False), max_model_len=64,
                   enforce_eager=True, gpu_memory_utilization=0.99)
