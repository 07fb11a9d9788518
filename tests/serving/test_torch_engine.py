"""The native engine: continuous batching, exact behaviour log-probs, sampling controls."""

from __future__ import annotations

import asyncio
import copy
import math
import threading

import pytest
import torch

from online_sao.config import ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.sampling import nucleus_logprobs, sample_token
from serving.engine.torch_engine import EngineStopped, StepStats, TorchEngine
from tests.fixtures.engine_reference import collect, reference_logprob, replay_logprobs
from tests.serving.fakes import StepGate

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [42], [7, 7, 7, 7], [100, 200, 300, 40, 10, 3]]
LOGPROB_TOL = 1e-4
"""float32 batched vs float64 one-at-a-time arithmetic differ by ~1e-6."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model gains nothing from intra-op threads


@pytest.fixture
def make_engine(kv_layout):
    def make(model, on_step=None, **cfg) -> TorchEngine:
        if kv_layout == "flat":  # it switches its model's attention function (grouped_attention.py)
            model = copy.deepcopy(model)
        return TorchEngine(model, cfg=ServingConfig(kv_layout=kv_layout, **cfg), on_step=on_step)

    return make


def request(i: int, prompt: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(f"r{i}", prompt, SamplingParams(**{"max_tokens": 16, **sampling}))


async def run_alone(engine, requests):
    return [await collect(engine, r) for r in requests]


async def run_together(engine, requests):
    return await asyncio.gather(*(collect(engine, r) for r in requests))


def run_in_turn(engine, requests, *runs) -> list:
    """Start ``engine``, serve ``requests`` with each of ``runs`` in turn, stop it: each run's results."""
    async def main():
        await engine.start()
        results = [await run(engine, requests) for run in runs]
        await engine.stop()
        return results

    return asyncio.run(main())


def tokens(events):
    return [e.token_id for e in events]


def assert_same_samples(a, b):
    assert tokens(a) == tokens(b)
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < LOGPROB_TOL


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    logp = nucleus_logprobs(logits, temperature=1.0, top_p=0.7)
    # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it: renormalised 0.625 / 0.375
    assert torch.allclose(logp[:2].exp(), torch.tensor([0.625, 0.375]))
    assert torch.isinf(logp[2:]).all()
    halved = nucleus_logprobs(torch.tensor([2.0, 0.0]), temperature=2.0, top_p=1.0)
    assert torch.allclose(halved.exp(), torch.softmax(torch.tensor([1.0, 0.0]), 0))


def test_tiny_temperature_is_greedy_and_its_logprob_not_positive():
    generator = torch.Generator().manual_seed(0)
    token, logprob, _ = sample_token(torch.tensor([1.0, 3.0, 2.999]), 1e-4, 1.0, generator)
    assert token == 1 and logprob <= 0.0


def test_alternatives_are_the_most_likely_tokens_of_the_nucleus():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    # top_p 0.6 keeps 0.4 and 0.3 (0.4 alone is short of 0.6): renormalised 4/7 and 3/7
    token, logprob, alternatives = sample_token(logits, 1.0, 0.6, generator, top_logprobs=3)
    assert [t for t, _ in alternatives] == [3, 2]
    assert [lp for _, lp in alternatives] == pytest.approx([math.log(4 / 7), math.log(3 / 7)], abs=1e-6)
    assert dict(alternatives)[token] == pytest.approx(logprob)
    assert sample_token(logits, 1.0, 0.6, generator)[2] == ()


@pytest.mark.parametrize("sampling", [dict(temperature=1e-4), dict(temperature=1.0, seed=7)])
def test_batched_decoding_matches_unbatched(model, sampling, make_engine):
    engine = make_engine(model, max_batch_size=8)
    requests = [request(i, p, **sampling) for i, p in enumerate(PROMPTS)]
    alone, together = run_in_turn(engine, requests, run_alone, run_together)
    for a, b in zip(alone, together):
        assert len(a) == 16 and a[-1].finish_reason == "length"
        assert_same_samples(a, b)


def test_request_joins_a_running_batch_at_the_next_step(model, make_engine, kv_layout):
    on_step = StepGate(hold_at=5)  # holds the loop until the second request is queued
    reached, resume, stats = on_step.reached, on_step.resume, on_step.stats
    engine = make_engine(model, on_step=on_step, max_batch_size=4)
    first = request(0, PROMPTS[1], temperature=0.8, seed=1, max_tokens=30)
    second = request(1, PROMPTS[0], temperature=0.8, seed=2, max_tokens=10)

    async def main():
        await engine.start()
        task_first = asyncio.ensure_future(collect(engine, first))
        await asyncio.to_thread(reached.wait, 10)
        task_second = asyncio.ensure_future(collect(engine, second))
        await asyncio.sleep(0.05)  # lets the task queue its request
        assert engine.waiting == 1
        resume.set()
        joined = await asyncio.gather(task_first, task_second)
        alone = await run_alone(engine, [first, second])
        await engine.stop()
        return joined, alone

    joined, alone = asyncio.run(main())
    for a, b in zip(alone, joined):
        assert_same_samples(a, b)
    kinds = [(s.kind, s.batch_size) for s in stats[: 5 + 1 + 1 + 1 + 2]]
    # prefill of the first, 5 steps alone, prefill of the second, then steps of both
    assert kinds[:6] == [("prefill", 1)] + [("decode", 1)] * 5
    if kv_layout == "padded":
        assert kinds[6] == ("prefill", 1) and kinds[7] == ("decode", 2)
    else:  # the second's prompt rides in the next decode step's forward
        assert kinds[6] == ("decode", 2) and kinds[7] == ("decode", 2)


@pytest.mark.parametrize("max_prefill_tokens,prefills,flat_forwards", [
    (8192, [3], [4]),  # all three in one forward (flat: with the running one)
    (12, [2, 1], [4]),  # padded: 3 and 6 tokens padded to 2 x 6 fit, a third row (3 x 6) does not;
    # flat: 3 + 6 + 1 = 10 prompt tokens fit
    (1, [1, 1, 1], [2, 3, 4]),  # every prompt is longer than the bound: each alone
])
def test_requests_queued_together_are_prefilled_together_as_if_alone(model, max_prefill_tokens, prefills, flat_forwards,
                                                                      make_engine, kv_layout):
    on_step = StepGate(hold_at=2)  # holds the loop while the next three requests queue
    engine = make_engine(model, on_step=on_step, max_batch_size=4, max_prefill_tokens=max_prefill_tokens)
    first = request(0, PROMPTS[1], temperature=0.8, seed=1, max_tokens=20)
    # prompts of 3, 6 and 1 tokens (left-padded in the prefill); the last ends at its first token
    queued = [request(1, PROMPTS[0], temperature=0.8, seed=2, max_tokens=12),
              request(2, PROMPTS[4], temperature=1.2, top_p=0.9, seed=3, max_tokens=12),
              request(3, PROMPTS[2], temperature=0.8, seed=4, max_tokens=1)]

    async def main():
        await engine.start()
        task_first = asyncio.ensure_future(collect(engine, first))
        await asyncio.to_thread(on_step.reached.wait, 10)
        tasks = [asyncio.ensure_future(collect(engine, r)) for r in queued]
        await asyncio.sleep(0.05)  # lets the tasks queue their requests
        assert engine.waiting == 3
        on_step.resume.set()
        together = await asyncio.gather(task_first, *tasks)
        alone = await run_alone(engine, [first, *queued])
        await engine.stop()
        return together, alone

    together, alone = asyncio.run(main())
    for a, b in zip(alone, together):
        assert_same_samples(a, b)
    assert [len(events) for events in together] == [20, 12, 12, 1]
    kinds = [(s.kind, s.batch_size) for s in on_step.stats]
    rounds = [("prefill", n) for n in prefills] if kv_layout == "padded" else [("decode", n) for n in flat_forwards]
    assert kinds[:3 + len(rounds)] == [("prefill", 1), ("decode", 1), ("decode", 1)] + rounds
    assert kinds[3 + len(rounds)] == ("decode", 3)  # the one that ended at its first token never decoded


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (1.5, 0.5)])
def test_logprobs_match_a_recomputation_under_the_sampling_distribution(model, temperature, top_p, make_engine):
    engine = make_engine(model, max_batch_size=8)
    requests = [request(i, p, temperature=temperature, top_p=top_p, seed=i) for i, p in enumerate(PROMPTS)]

    async def main():
        await engine.start()
        out = await run_together(engine, requests)
        await engine.stop()
        return out

    for req, events in zip(requests, asyncio.run(main())):
        assert all(e.version == 0 for e in events)
        expected = replay_logprobs({0: model}, req.prompt_ids, events, temperature, top_p)
        assert all(math.isfinite(x) for x in expected)  # every sampled token lies in its nucleus
        assert max(abs(e.logprob - x) for e, x in zip(events, expected)) < LOGPROB_TOL


def test_full_recomputation_agrees_with_the_incremental_reference(model, make_engine):
    prompt = PROMPTS[3]
    engine = make_engine(model)

    async def main():
        await engine.start()
        events = await collect(engine, request(0, prompt, temperature=0.9, top_p=0.9, seed=3))
        await engine.stop()
        return events

    events = asyncio.run(main())
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens(events)])).logits[0]
    full = [reference_logprob(logits[len(prompt) - 1 + k], e.token_id, 0.9, 0.9) for k, e in enumerate(events)]
    assert max(abs(e.logprob - x) for e, x in zip(events, full)) < LOGPROB_TOL


def test_seeds_are_reproducible_and_distinct(model, make_engine):
    engine = make_engine(model)
    same = [request(i, PROMPTS[0], temperature=1.5, seed=11, max_tokens=24) for i in range(2)]
    other = request(2, PROMPTS[0], temperature=1.5, seed=12, max_tokens=24)

    async def main():
        await engine.start()
        out = await run_alone(engine, same + [other])
        await engine.stop()
        return out

    a, b, c = asyncio.run(main())
    assert tokens(a) == tokens(b) and [e.logprob for e in a] == [e.logprob for e in b]
    assert tokens(a) != tokens(c)


def test_stop_token_ends_generation_and_max_tokens_caps_it(model, make_engine):
    engine = make_engine(model)
    base = dict(temperature=1.2, seed=5, max_tokens=20)

    async def main():
        await engine.start()
        free = await collect(engine, request(0, PROMPTS[2], **base))
        stop_id = free[3].token_id
        stopped = await collect(engine, GenerationRequest("s", PROMPTS[2], SamplingParams(**base),
                                                          stop_token_ids=frozenset({stop_id})))
        short = await collect(engine, request(1, PROMPTS[2], **{**base, "max_tokens": 3}))
        await engine.stop()
        return free, stop_id, stopped, short

    free, stop_id, stopped, short = asyncio.run(main())
    first = tokens(free).index(stop_id)
    assert tokens(stopped) == tokens(free)[: first + 1]  # the stop token is sampled and reported
    assert stopped[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in stopped[:-1])
    assert tokens(short) == tokens(free)[:3] and short[-1].finish_reason == "length"
    assert len(free) == 20 and free[-1].finish_reason == "length"


def test_requests_beyond_max_batch_size_wait_their_turn(model, make_engine):
    stats: list[StepStats] = []
    engine = make_engine(model, on_step=stats.append, max_batch_size=2)
    requests = [request(i, p, temperature=1.0, seed=i, max_tokens=8) for i, p in enumerate(PROMPTS)]
    together, alone = run_in_turn(engine, requests, run_together, run_alone)
    for a, b in zip(alone, together):
        assert_same_samples(a, b)
    decode_sizes = [s.batch_size for s in stats if s.kind == "decode"]
    assert max(decode_sizes) == 2
    assert engine.running == 0 and engine.waiting == 0


def test_a_consumer_that_leaves_frees_its_slot(model, make_engine):
    engine = make_engine(model, max_batch_size=2)

    async def main():
        await engine.start()
        agen = engine.generate(request(0, PROMPTS[0], max_tokens=200))
        first = await agen.__anext__()
        await agen.aclose()
        rest = await run_together(engine, [request(i, PROMPTS[i], max_tokens=5) for i in (1, 2)])
        await engine.stop()
        return first, rest

    first, rest = asyncio.run(main())
    assert first.finish_reason is None
    assert [len(r) for r in rest] == [5, 5]
    assert engine.running == 0


def test_bad_prompts_are_refused_and_the_context_limit_ends_generation(model, make_engine):
    engine = make_engine(model)
    vocab = model.get_input_embeddings().num_embeddings

    async def main():
        with pytest.raises(EngineStopped):
            await collect(engine, request(0, PROMPTS[0]))  # not started
        await engine.start()
        with pytest.raises(ValueError, match="no tokens"):
            await collect(engine, request(0, []))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, request(0, [vocab]))
        with pytest.raises(ValueError, match="no room"):
            await collect(engine, request(0, [1] * model.config.max_position_embeddings))
        near_end = await collect(engine, request(0, [1] * (model.config.max_position_embeddings - 2), max_tokens=50))
        await engine.stop()
        return near_end

    near_end = asyncio.run(main())
    assert len(near_end) == 2 and near_end[-1].finish_reason == "length"


def test_stop_ends_running_and_waiting_requests(model, make_engine):
    reached, resume = threading.Event(), threading.Event()

    def on_step(s: StepStats) -> None:
        if s.kind == "decode" and not reached.is_set():
            reached.set()
            assert resume.wait(10)

    engine = make_engine(model, on_step=on_step, max_batch_size=1)

    async def main():
        await engine.start()
        tasks = [asyncio.ensure_future(collect(engine, request(i, PROMPTS[i], max_tokens=200))) for i in (0, 1)]
        await asyncio.to_thread(reached.wait, 10)
        stopping = asyncio.ensure_future(engine.stop())
        await asyncio.sleep(0.05)  # the stop flag is set before the loop resumes
        resume.set()
        await stopping
        return await asyncio.gather(*tasks, return_exceptions=True)

    running, waiting = asyncio.run(main())
    assert isinstance(running, EngineStopped) and isinstance(waiting, EngineStopped)


# padded compiles a graph per cache length: 45-70 s on 2 cores, so the slow lane; flat in the default run
@pytest.mark.parametrize("kv_layout", ["flat", pytest.param("padded", marks=pytest.mark.slow)])
def test_a_compiled_engine_compiles_while_it_starts_and_answers_as_the_eager_one(model, kv_layout):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # graphs other tests compiled for this model would hide what the warm-up builds
    eager = TorchEngine(copy.deepcopy(model), cfg=ServingConfig(kv_layout=kv_layout, max_batch_size=8))
    compiled = TorchEngine(copy.deepcopy(model), cfg=ServingConfig(kv_layout=kv_layout, max_batch_size=8,
                                                                   compile=True))
    # one alone, then several of different lengths together: the cache grows, rows leave, rows join
    alone = [request(0, PROMPTS[1], max_tokens=90, seed=0)]
    together = [request(i, p, max_tokens=20 + 25 * i, seed=i) for i, p in enumerate(PROMPTS)]
    graphs: dict[str, int] = {}

    async def main(engine):
        await engine.start()
        graphs["started"] = counters["stats"]["unique_graphs"]
        out = [await run_alone(engine, alone), await run_together(engine, together)]
        graphs["served"] = counters["stats"]["unique_graphs"]
        await engine.stop()
        return out

    served = asyncio.run(main(compiled))
    assert graphs["started"] > 0 and graphs["served"] == graphs["started"]  # no compiling while serving
    assert compiled.compiled
    for got, want in zip(served, asyncio.run(main(eager))):
        for a, b in zip(got, want):
            assert_same_samples(a, b)
