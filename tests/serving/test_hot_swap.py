"""Hot-swap in the native engine: switch between two steps, never fail a request."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch

from online_sao.config import ServingConfig
from online_sao.modeling import load_policy
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
import serving.engine.torch_engine as torch_engine
from serving.engine.torch_engine import TorchEngine
from tests.fixtures.engine_reference import collect, replay_logprobs
from tests.serving.fakes import StepGate

LOGPROB_TOL = 1e-4
"""float32 batched vs float64 one-at-a-time arithmetic differ by ~1e-6."""
NOISE = 0.05
"""Scale of the perturbation that makes version 1: large enough that the two
versions' log-probs differ far beyond LOGPROB_TOL."""
TEMPERATURE, TOP_P = 0.9, 0.95
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [42], [7, 7, 7, 7], [100, 200, 300], [3, 1], [9] * 12, [11, 12]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def versions(base_model) -> dict[int, torch.nn.Module]:
    """Version 0 is the base model; version 1 a perturbed copy."""
    generator = torch.Generator().manual_seed(0)
    perturbed = copy.deepcopy(base_model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=generator))
    return {0: base_model, 1: perturbed}


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def request(i: int, prompt: list[int], max_tokens: int = 40, **sampling) -> GenerationRequest:
    params = {"temperature": TEMPERATURE, "top_p": TOP_P, "seed": i, "max_tokens": max_tokens, **sampling}
    return GenerationRequest(f"r{i}", prompt, SamplingParams(**params))


@pytest.mark.parametrize("kv_layout,compiled", [("padded", False), ("flat", False), ("padded", True), ("flat", True)],
                         ids=["padded", "flat", "padded-compiled", "flat-compiled"])
@pytest.mark.parametrize("in_place", [False, True], ids=["spare-copy", "in-place"])
def test_swap_while_eight_requests_stream(base_model, versions, in_place, kv_layout, compiled):
    on_step = StepGate(hold_at=10, armed=not compiled)  # holds the loop until the swap is loaded and queued
    reached, resume, stats = on_step.reached, on_step.resume, on_step.stats
    engine = TorchEngine(copy.deepcopy(base_model), on_step=on_step,
                         cfg=ServingConfig(max_batch_size=8, swap_in_place=in_place, kv_layout=kv_layout,
                                           compile=compiled))
    requests = [request(i, p) for i, p in enumerate(PROMPTS)]
    warm_up: list = []

    async def main():
        await engine.start()
        warm_up.extend(stats)  # steps the engine ran before any request: its warm-up when compiled
        on_step.arm()
        streams = [asyncio.ensure_future(collect(engine, r)) for r in requests]
        await asyncio.to_thread(reached.wait, 10)
        swap = asyncio.ensure_future(asyncio.to_thread(engine.swap_weights, 1, state_of(versions[1])))
        while not engine.switch_pending:
            await asyncio.sleep(0.005)
        resume.set()
        results = await asyncio.gather(*streams)
        result = await swap
        await engine.stop()
        return results, result

    results, swap = asyncio.run(main())
    assert bool(warm_up) == compiled
    assert swap.applied and swap.version == 1 and engine.policy_version == 1
    assert engine.compiled == compiled  # with a spare, both copies: the swap did not switch to an eager one
    assert swap.load_s > 0 and swap.stall_s >= 0
    switches = [s for s in stats if s.kind == "switch"]
    assert len(switches) == 1
    for req, events in zip(requests, results):
        assert len(events) == 40 and events[-1].finish_reason == "length"
        seen = [e.version for e in events]
        # every request was in flight at the switch: old tokens first, then new ones
        assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 1
        expected = replay_logprobs(versions, req.prompt_ids, events, TEMPERATURE, TOP_P)
        assert max(abs(e.logprob - x) for e, x in zip(events, expected)) < LOGPROB_TOL
    # the check can tell the versions apart: replaying everything under version 0 disagrees
    old_only = [replay_logprobs({1: versions[0], 0: versions[0]}, r.prompt_ids, ev, TEMPERATURE, TOP_P)
                for r, ev in zip(requests, results)]
    worst = max(abs(e.logprob - x) for ev, xs in zip(results, old_only) for e, x in zip(ev, xs))
    assert worst > 100 * LOGPROB_TOL


def generate_once(engine, prompt=(1, 2, 3)):
    async def main():
        await engine.start()
        events = await collect(engine, request(0, list(prompt), max_tokens=12))
        await engine.stop()
        return events

    return asyncio.run(main())


def test_older_version_is_ignored_unless_forced(base_model, versions):
    engine = TorchEngine(copy.deepcopy(base_model), initial_version=5)
    ignored = engine.swap_weights(3, state_of(versions[1]))
    assert not ignored.applied and "not newer" in ignored.reason
    same = engine.swap_weights(5, state_of(versions[1]))
    assert not same.applied
    assert engine.policy_version == 5
    before = generate_once(engine)
    assert all(e.version == 5 for e in before)
    assert replay_logprobs({5: versions[0]}, [1, 2, 3], before, TEMPERATURE, TOP_P) == pytest.approx(
        [e.logprob for e in before], abs=LOGPROB_TOL)

    rollback = engine.swap_weights(3, state_of(versions[1]), force=True)
    assert rollback.applied and engine.policy_version == 3
    after = generate_once(engine)
    assert all(e.version == 3 for e in after)
    assert replay_logprobs({3: versions[1]}, [1, 2, 3], after, TEMPERATURE, TOP_P) == pytest.approx(
        [e.logprob for e in after], abs=LOGPROB_TOL)


def corruptions(good: dict[str, torch.Tensor]):
    name = next(k for k, v in good.items() if v.is_floating_point() and v.dim() == 2)
    nan = dict(good)
    nan[name] = good[name].clone()
    nan[name][0, 0] = float("nan")
    yield "non-finite", nan
    shape = dict(good)
    shape[name] = good[name][:, :-1].clone()
    yield "shape", shape
    missing = dict(good)
    del missing["model.norm.weight"]
    yield "missing", missing
    extra = dict(good, **{"surprise.weight": torch.zeros(2)})
    yield "unexpected", extra
    yield "empty", {}
    beyond = dict(good)  # finite in float64, inf once load_state_dict casts it to the model's float32
    beyond[name] = good[name].double()
    beyond[name][0, 0] = 1e39
    yield "range", beyond
    if "lm_head.weight" in good and "model.embed_tokens.weight" in good:
        untied = dict(good)
        untied["lm_head.weight"] = good["lm_head.weight"] + 1.0
        yield "tied", untied


@pytest.mark.parametrize("in_place", [False, True], ids=["spare-copy", "in-place"])
def test_corrupt_weights_are_refused_and_the_old_ones_stay(base_model, versions, in_place):
    engine = TorchEngine(copy.deepcopy(base_model), cfg=ServingConfig(swap_in_place=in_place))
    before = generate_once(engine)
    tried = []
    for why, bad in corruptions(state_of(versions[1])):
        result = engine.swap_weights(1, bad)
        assert not result.applied and result.reason.startswith("refused"), why
        assert why in result.reason
        tried.append(why)
    # every corruption ran: the tied one too (the fixture model ties its embeddings, so both names are there)
    assert tried == ["non-finite", "shape", "missing", "unexpected", "empty", "range", "tied"]
    assert engine.policy_version == 0
    after = generate_once(engine)
    assert [(e.token_id, e.logprob, e.version) for e in after] == [(e.token_id, e.logprob, e.version) for e in before]


def test_a_missing_tied_alias_is_taken_from_its_twin(base_model, versions):
    # a fixture that stopped tying would leave the alias path untested: a failure, not a skip
    assert base_model.config.tie_word_embeddings
    engine = TorchEngine(copy.deepcopy(base_model))
    state = state_of(versions[1])
    del state["lm_head.weight"]
    assert engine.swap_weights(1, state).applied
    events = generate_once(engine)
    assert replay_logprobs({1: versions[1]}, [1, 2, 3], events, TEMPERATURE, TOP_P) == pytest.approx(
        [e.logprob for e in events], abs=LOGPROB_TOL)


def test_concurrent_swaps_serialise_and_the_newest_wins(base_model, versions):
    engine = TorchEngine(copy.deepcopy(base_model))
    state = state_of(versions[1])

    async def main():
        await engine.start()
        results = await asyncio.gather(*(asyncio.to_thread(engine.swap_weights, v, state) for v in (1, 2, 3)))
        await engine.stop()
        return results

    results = asyncio.run(main())
    assert engine.policy_version == 3
    assert all(r.applied or "not newer" in r.reason for r in results)


def test_the_flat_layout_with_nothing_to_run_runs_no_forward(base_model):
    """Every request admitted in a round cancelled, no row running: no work, no error."""
    engine = TorchEngine(copy.deepcopy(base_model), cfg=ServingConfig(kv_layout="flat"))
    engine._flat_step([])  # raised "cannot reshape tensor of 0 elements" and was logged as a failed step
    assert engine._rows == []


def test_the_spare_copy_is_made_once_when_a_start_and_a_swap_both_want_it(base_model, monkeypatch):
    """A start with ``compile`` makes the spare on a worker thread while the follower, replaying the
    weights topic, may swap: both found no spare and each made one (twice the time and memory)."""
    engine = TorchEngine(copy.deepcopy(base_model), cfg=ServingConfig())
    real_deepcopy, copies = copy.deepcopy, []

    def slow_deepcopy(obj, *rest):
        if obj is engine._model:
            copies.append(obj)
            time.sleep(0.2)  # the other caller arrives while this copy is being made
        return real_deepcopy(obj, *rest)

    monkeypatch.setattr(torch_engine.copy, "deepcopy", slow_deepcopy)
    makers = [threading.Thread(target=engine._make_spare) for _ in range(2)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(30)
    assert len(copies) == 1 and engine._spare is not None
