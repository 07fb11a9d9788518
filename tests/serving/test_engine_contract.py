"""What every inference engine promises, run against each engine behind the seam.

The native engine runs in the default run; the vLLM engine only in the vLLM lane
(``make test-vllm``, marker ``vllm``), where a vLLM that does not import is an
error, not a skip. The promises: behaviour log-probs under the exact sampling
distribution (temperature and top-p), equal to the learner's own log-probs of the
logged record at the same weights, stop tokens, and a hot-swap with requests in
flight that stamps every token with the version that sampled it. Also: greedy
decoding at the greedy temperature, a temperature an engine cannot sample refused
(never changed behind the record's back), the same weight checks, and failures
(a refused request, a failing step, non-finite logits) that end only the requests
they concern. Tests marked ``only_vllm`` check what only the vLLM engine must do.

vLLM's CPU attention kernels need a head size of at least 32, so the model is a
random-weight Qwen2 of that shape with the tiny fixture's tokenizer.
"""

from __future__ import annotations

import asyncio
import copy
import threading

import numpy as np
import pytest
import torch

from online_sao.config import ServingConfig
from online_sao.sampling import nucleus_logprobs
from online_sao.schemas import SamplingParams
from serving.engine import torch_engine
from serving.engine.base import EngineStopped, GenerationRequest
from serving.engine.sampling import GREEDY_TEMPERATURE, NonFiniteLogits
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
REPLY_TIMEOUT_S = 60
"""Longest wait for a request's tokens: an engine whose loop died leaves its requests waiting forever,
which must fail a test, not hang it."""
LOGIT_TOL = 5e-6
"""How far an engine's float32 logits may be from the float64 reference's: a few float32 ulps at this
model's logit size (1.6e-6 seen). A log-probability at temperature T moves by up to twice that over T,
which outgrows LOGPROB_TOL below T = 0.05 (0.1 nats at the greedy temperature)."""
EDGE_TEMPERATURES = (0.005, 2.5, 10.0)
"""Temperatures the API accepts (MIN_TEMPERATURE to 10, online_sao.schemas) that an engine may be unable
to sample: between the greedy threshold and vLLM's lowest (0.01), above vLLM's highest (2), the API's
highest."""
SEED_RESIDUES = 2 ** 64
"""A torch generator seeds with its 64-bit seed modulo this (``manual_seed``): -1 and 2**64 - 1 are one seed."""
ABOVE_GREEDY_IN_FLOAT64 = 1.00000001e-4
"""A temperature the API accepts that is above GREEDY_TEMPERATURE as a Python float and equal to it in
float32, the learner's dtype: greedy."""
SEED_TEMPERATURE = 2.0
"""The seed test's temperature: vLLM's highest, where this model's draws are least certain."""
TIE_DRAWS = 40
"""Requests (one token each, seeds 0..) drawn at a cut-off between two tied tokens: the kept one of the pair
has probability about 1/4 in the nucleus, so all of them missing it would take about 1e-5 luck (and the
seeds fix the draws: it does not vary from run to run)."""
TIE_FLATTENING = 8.0
"""The tie test's model divides the contract model's LM head by this (its fixture's sharpening): the most
likely token then no longer takes almost all the mass, so the tied pair at the cut-off is drawn."""
OVERFLOW_NORM = 3e38
"""A final-norm weight that is finite and within float32 (so every weight check passes) and overflows
the hidden states to inf, so the logits are not finite."""


def only_vllm(test):
    """A test of what only the vLLM engine does, on the module's vLLM engine (not a second one)."""
    return pytest.mark.vllm(pytest.mark.parametrize("engine", ["vllm"], indirect=True)(test))


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


def tolerance(temperature: float) -> float:
    """How far a log-probability at ``temperature`` may be from the float64 reference's."""
    return max(LOGPROB_TOL, 2 * LOGIT_TOL / temperature)


def log_space_reference(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    """Every token's float64 log-probability under the sampling distribution, -inf outside the nucleus:
    ``reference_logprob`` in log space, where probabilities at a greedy temperature underflow to 0."""
    z = logits.double().numpy() / temperature
    logp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    order = np.argsort(-logp, kind="stable")
    probs = np.exp(logp[order])
    keep = (np.cumsum(probs) - probs < top_p) | (top_p >= 1.0)
    keep[0] = True
    kept = order[keep]
    out = np.full_like(logp, -np.inf)
    out[kept] = logp[kept] - np.log(np.exp(logp[kept]).sum())
    return out


async def consume(engine, req, started: asyncio.Event):
    """``collect``, setting ``started`` at the first token."""
    events = []
    async for event in engine.generate(req):
        events.append(event)
        started.set()
    return events


def within(awaitable):
    return asyncio.wait_for(awaitable, REPLY_TIMEOUT_S)


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
    assert len(events) == 8  # else an empty answer would pass the loop below unchecked
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


def test_every_seed_the_api_accepts_reproduces_its_tokens(engine):
    """A seeded request gives the same tokens every time, for every seed the API accepts (any 64-bit
    integer, signed or not), -1 included (vLLM reads -1 as "no seed"); a seed and its residue modulo
    2**64 are the same generator seed. Another seed gives other tokens: at SEED_TEMPERATURE the draws
    are far from certain, so equal tokens say the seed fixed them (at this model's sharpened
    temperature 1 an unseeded request gave the same tokens by chance)."""
    seeds = (-1, -1, SEED_RESIDUES - 1, 7)

    async def main():
        await engine.start()
        out = [await within(collect(engine, request(400 + k, PROMPTS[1], seed=seed, temperature=SEED_TEMPERATURE,
                                                    top_p=1.0)))
               for k, seed in enumerate(seeds)]
        await engine.stop()
        return out

    first, again, residue, other = ([e.token_id for e in events] for events in asyncio.run(main()))
    assert len(first) == len(other) == 12
    assert first == again == residue
    assert other != first


def test_greedy_decoding_logs_the_point_mass_and_lists_the_tempered_alternatives(engine, versions):
    """At or below GREEDY_TEMPERATURE the arg-max is taken and its logged log-probability is 0 (the point
    mass chose it); the alternatives are those of the request's tempered nucleus distribution. "At or
    below" as the learner reads it, on the float32 temperature: ABOVE_GREEDY_IN_FLOAT64 too (the vLLM
    engine refused it as a temperature it cannot sample)."""
    count = 5
    requests = [GenerationRequest(f"greedy-{temperature}-{top_p}", PROMPTS[1], SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=8), top_logprobs=count)
        for temperature, top_p in ((GREEDY_TEMPERATURE, 1.0), (GREEDY_TEMPERATURE, TOP_P), (ABOVE_GREEDY_IN_FLOAT64, 1.0))]
    assert ABOVE_GREEDY_IN_FLOAT64 > GREEDY_TEMPERATURE

    async def main():
        await engine.start()
        out = await within(asyncio.gather(*(collect(engine, r) for r in requests)))
        await engine.stop()
        return out

    for req, events in zip(requests, asyncio.run(main())):
        assert len(events) == 8
        logits = replay_logits({engine.policy_version: versions[0]}, req.prompt_ids, events)
        for event, z in zip(events, logits):
            reference = log_space_reference(z, req.sampling.temperature, req.sampling.top_p)
            assert event.logprob == 0.0 and event.token_id == int(z.argmax())
            ranked = [int(t) for t in np.argsort(-reference, kind="stable")[:count] if reference[t] > -np.inf]
            assert [t for t, _ in event.top_logprobs] == ranked
            for token, logprob in event.top_logprobs:
                assert abs(logprob - reference[token]) < tolerance(GREEDY_TEMPERATURE), (token, logprob, reference[token])


def test_a_temperature_the_api_accepts_is_sampled_exactly_or_refused_alone(engine, versions):
    """Each edge temperature is either sampled from exactly that distribution or refused by ``generate``
    with a ValueError (a 400) before anything is sampled; a request in flight meanwhile, and the next
    one, are served as if nothing happened."""
    outcomes = {}

    async def main():
        await engine.start()
        started = asyncio.Event()
        running = asyncio.ensure_future(consume(engine, request(300, PROMPTS[1], max_tokens=SWAP_TOKENS), started))
        await within(started.wait())
        for k, temperature in enumerate(EDGE_TEMPERATURES):
            req = request(310 + k, PROMPTS[0], temperature=temperature, top_p=1.0)
            try:
                outcomes[temperature] = req, await within(collect(engine, req))
            except ValueError as exc:
                outcomes[temperature] = req, exc
        after = await within(collect(engine, request(320, PROMPTS[2])))
        out = await within(running), after
        await engine.stop()
        return out

    running, after = asyncio.run(main())
    if isinstance(engine, TorchEngine):  # the native engine samples every temperature the API accepts
        assert {t for t, (_, outcome) in outcomes.items() if isinstance(outcome, ValueError)} == set()
    served = {engine.policy_version: versions[0]}
    for temperature, (req, outcome) in outcomes.items():
        if isinstance(outcome, ValueError):  # a 400 naming the temperature, not the prompt
            assert getattr(outcome, "field", None) == "temperature", outcome
            continue
        assert len(outcome) == 12
        expected = replay_logprobs(served, req.prompt_ids, outcome, temperature, 1.0)
        assert worst_error(outcome, expected) < tolerance(temperature), temperature
    assert len(running) == SWAP_TOKENS and len(after) == 12
    for prompt, events in ((PROMPTS[1], running), (PROMPTS[2], after)):
        assert worst_error(events, replay_logprobs(served, prompt, events, TEMPERATURE, TOP_P)) < LOGPROB_TOL


def test_the_weight_checks_are_the_same_on_every_engine(engine, versions):
    """Weights that load but do not serve what was published are refused, the serving version kept;
    a tied twin left out is taken from the other, as the native engine's complete_state_dict does."""
    state = {k: v.clone() for k, v in versions[0].state_dict().items()}
    embed, head, norm = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    refused = {
        "int": (dict(state, **{down: torch.ones_like(state[down], dtype=torch.int64)}), "torch.int64"),
        "bool": (dict(state, **{norm: torch.ones_like(state[norm], dtype=torch.bool)}), "torch.bool"),
        "beyond float32": (dict(state, **{norm: state[norm].double().index_fill(0, torch.tensor([0]), 1e39)}),
                           "beyond"),
        "tied twins differ": (dict(state, **{head: state[head] + 1.0}), "tied"),
    }
    version = engine.policy_version
    for case, (bad, reason) in refused.items():
        result = engine.swap_weights(version + 1, bad)
        assert not result.applied and reason in result.reason, case
        assert engine.policy_version == version
    only_head = {k: v for k, v in state.items() if k != embed}  # the same values as served: nothing changes
    assert engine.swap_weights(version + 1, only_head).applied and engine.policy_version == version + 1


def test_non_finite_logits_fail_the_request_instead_of_logging_nan(engine, versions):
    state = {k: v.clone() for k, v in versions[0].state_dict().items()}
    overflowing = dict(state, **{"model.norm.weight": torch.full_like(state["model.norm.weight"], OVERFLOW_NORM)})
    version = engine.policy_version
    assert engine.swap_weights(version + 1, overflowing).applied

    async def sample(i):
        await engine.start()
        try:
            return await within(collect(engine, request(i, PROMPTS[0])))
        finally:
            await engine.stop()

    with pytest.raises(NonFiniteLogits):
        asyncio.run(sample(330))
    assert engine.swap_weights(version + 2, state).applied
    events = asyncio.run(sample(331))
    served = {engine.policy_version: versions[0]}
    assert worst_error(events, replay_logprobs(served, PROMPTS[0], events, TEMPERATURE, TOP_P)) < LOGPROB_TOL


def failing_once(monkeypatch, owner, name: str) -> threading.Event:
    """``owner.name`` raises "injected step failure" once, the next time it is called after the returned
    event is set."""
    original = getattr(owner, name)
    armed = threading.Event()

    def step(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected step failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, step)
    return armed


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(engine, versions, monkeypatch):
    """An exception in the model step fails the requests it was serving, not the engine."""
    # the native engine's step ends in sample_tokens; vLLM's is LLMEngine.step
    owner, name = (torch_engine, "sample_tokens") if isinstance(engine, TorchEngine) else (engine._llm, "step")
    armed = failing_once(monkeypatch, owner, name)

    async def main():
        await engine.start()
        started = asyncio.Event()
        running = asyncio.ensure_future(consume(engine, request(340, PROMPTS[1], max_tokens=SWAP_TOKENS), started))
        await within(started.wait())
        armed.set()
        with pytest.raises(RuntimeError, match="injected step failure"):
            await within(running)
        after = await within(collect(engine, request(341, PROMPTS[2])))
        await engine.stop()
        return after

    after = asyncio.run(main())
    assert len(after) == 12 and after[-1].finish_reason == "length"
    served = {engine.policy_version: versions[0]}
    assert worst_error(after, replay_logprobs(served, PROMPTS[2], after, TEMPERATURE, TOP_P)) < LOGPROB_TOL


@only_vllm
def test_vllm_refuses_a_request_id_already_in_flight(engine):
    """vLLM keys its requests by id: a second one in flight would take the first one's tokens."""
    twin = GenerationRequest("twin", PROMPTS[0], SamplingParams(seed=1, max_tokens=8))

    async def main():
        await engine.start()
        stream = engine.generate(twin)
        first = await within(anext(stream))
        with pytest.raises(ValueError, match="already in flight"):
            await within(collect(engine, twin))
        events = [first] + await within(rest(stream))
        again = await within(collect(engine, twin))  # finished: the id is free again
        await engine.stop()
        return events, again

    async def rest(stream):
        return [event async for event in stream]

    events, again = asyncio.run(main())
    assert len(events) == len(again) == 8
    assert [e.token_id for e in events] == [e.token_id for e in again]  # seeded: the same sequence


class LoopKilled(BaseException):
    """Not an Exception: no guard of the engine catches it, so the loop thread dies of it."""


@only_vllm
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_vllm_a_dead_loop_stops_its_requests_and_refuses_new_ones(engine, monkeypatch):
    """Should the loop thread die anyway (of what no guard catches), nobody waits forever: the requests
    in flight end with EngineStopped and new ones are refused until the engine is started again."""
    def step(*args, **kwargs):
        raise LoopKilled()

    async def main():
        await engine.start()
        started = asyncio.Event()
        running = asyncio.ensure_future(consume(engine, request(350, PROMPTS[1], max_tokens=SWAP_TOKENS), started))
        await within(started.wait())
        monkeypatch.setattr(engine._llm, "step", step)
        with pytest.raises(EngineStopped, match="LoopKilled"):
            await within(running)
        with pytest.raises(EngineStopped):
            await within(collect(engine, request(351, PROMPTS[0])))
        monkeypatch.undo()
        await engine.stop()  # and start again: a fresh loop serves
        await engine.start()
        after = await within(collect(engine, request(352, PROMPTS[2])))
        await engine.stop()
        return after

    after = asyncio.run(main())
    assert len(after) == 12 and after[-1].finish_reason == "length"


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
    # a rollback or an operator's hold loads an older version, forced
    back = engine.swap_weights(start_version, {k: v.clone() for k, v in versions[0].state_dict().items()}, force=True)
    assert back.applied and engine.policy_version == start_version

    async def answer(req):
        await engine.start()
        events = await collect(engine, req)
        await engine.stop()
        return events

    events = asyncio.run(answer(request(99, PROMPTS[0], max_tokens=4)))
    assert len(events) == 4 and {e.version for e in events} == {start_version}
    assert worst_error(events, replay_logprobs(models, PROMPTS[0], events, TEMPERATURE, TOP_P)) < LOGPROB_TOL


def tied_at_the_cut_off(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.nn.Module, int, int, float]:
    """A flatter copy of ``model`` (:data:`TIE_FLATTENING`) whose next-token logits after ``prompt`` tie its
    third most likely token ``a`` with the highest id ``b`` of the others (the output row of ``a`` copied to
    ``b``), and the top-p whose cut-off falls inside the pair: the mass of the two tokens above them plus
    half of one. The learner keeps the lower id of a tie (a stable sort): ``a`` is in its nucleus, ``b``
    is not."""
    tied = copy.deepcopy(model)
    with torch.no_grad():
        tied.lm_head.weight.div_(TIE_FLATTENING)
        logits = tied(torch.tensor([prompt])).logits[0, -1]
        order = torch.argsort(logits, descending=True, stable=True).tolist()
        a = order[2]
        b = max(order[3:])  # the highest id: vLLM's own top-p (an ascending sort) kept the last of a tie
        tied.lm_head.weight[b] = tied.lm_head.weight[a]  # tied embeddings: the input row of b too, unused here
        logits = tied(torch.tensor([prompt])).logits[0, -1]
    assert b > a and logits[a] == logits[b]
    probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    above = torch.argsort(logits, descending=True, stable=True)[:2].tolist()
    assert a not in above and b not in above
    return tied, a, b, float(probs[above].sum() + probs[a] / 2)


def test_tied_tokens_at_the_nucleus_cut_off_keep_the_learners_one(engine, versions):
    """Two tokens tied at the top-p cut-off: the engine keeps the one the learner keeps (the lower id),
    so every token it draws has the learner's finite log-probability, equal to the logged one, and its
    alternatives are the learner's nucleus. vLLM's own top-p kept the higher id of such a pair: the
    learner scored a drawn token -inf."""
    prompt = PROMPTS[1]
    tied, a, b, top_p = tied_at_the_cut_off(versions[0], prompt)
    start_version = engine.policy_version
    assert engine.swap_weights(start_version + 1, {k: v.clone() for k, v in tied.state_dict().items()}).applied
    requests = [GenerationRequest(f"tie-{i}", prompt, SamplingParams(temperature=TEMPERATURE, top_p=top_p, seed=i,
                                                                     max_tokens=1), top_logprobs=5)
                for i in range(TIE_DRAWS)]

    async def main():
        await engine.start()
        out = await within(asyncio.gather(*(collect(engine, r) for r in requests)))
        await engine.stop()
        return out

    try:
        drawn = [events[0] for events in asyncio.run(main())]
    finally:  # the next test finds the engine as the module left it
        engine.swap_weights(start_version, {k: v.clone() for k, v in versions[0].state_dict().items()}, force=True)
    with torch.no_grad():
        learner = nucleus_logprobs(tied(torch.tensor([prompt])).logits[0, -1], TEMPERATURE, top_p)
    nucleus = [t for t in torch.argsort(learner, descending=True, stable=True).tolist() if learner[t] > -torch.inf]
    assert a in nucleus and b not in nucleus and len(nucleus) == 3
    for event in drawn:
        assert event.version == start_version + 1
        assert abs(event.logprob - float(learner[event.token_id])) < LOGPROB_TOL, (event.token_id, a, b)
        assert [t for t, _ in event.top_logprobs] == nucleus
        for token, logprob in event.top_logprobs:
            assert abs(logprob - float(learner[token])) < LOGPROB_TOL
    assert a in {event.token_id for event in drawn}  # the kept one of the pair was drawn, not only listed
