"""The native engine's loop survives a failure outside one model call (selecting the cache's rows: out of
memory on a large batch): the requests in the batch fail, later ones are served and a swap goes through.
A loop thread that died there left every request waiting for its deadline and every swap blocked. So does a
step callback (``on_step``) that raises."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest

from online_sao.config import ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import StepStats, TorchEngine
from tests.fixtures.engine_reference import collect

WAIT_S = 30.0
"""Longest wait for an answer or a swap; a dead loop never gives one."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model gains nothing from intra-op threads


class InjectedFailure(RuntimeError):
    """The failure the test injects."""


class Trap:
    """Raises :class:`InjectedFailure` at the next ``shots`` calls once armed (calls come from the loop thread)."""

    def __init__(self) -> None:
        self.shots = 0

    def fire(self, where: str) -> None:
        if self.shots > 0:
            self.shots -= 1
            raise InjectedFailure(f"injected failure in {where}")


def long_request(i: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=200, seed=i))


def trapped_engine(model, kv_layout: str, monkeypatch, arm) -> TorchEngine:
    """An engine whose batch's ``select`` raises while its trap is armed; ``arm(engine, select_trap)`` runs on
    the loop thread after each decode step of two running requests, until it returns True."""
    if kv_layout == "flat":  # it switches its model's attention function (grouped_attention.py)
        model = copy.deepcopy(model)
    armed = threading.Event()
    select_trap = Trap()

    def on_step(stats: StepStats) -> None:
        if stats.kind == "decode" and stats.batch_size == 2 and not armed.is_set() and arm(engine, select_trap):
            armed.set()

    engine = TorchEngine(model, cfg=ServingConfig(kv_layout=kv_layout, max_batch_size=4), on_step=on_step)
    batch_type = type(engine._batch)
    original = batch_type.select

    def select(batch, keep):
        select_trap.fire("select")
        return original(batch, keep)

    monkeypatch.setattr(batch_type, "select", select)
    return engine


async def first_error(engine: TorchEngine, request: GenerationRequest) -> BaseException | None:
    try:
        await asyncio.wait_for(collect(engine, request), WAIT_S)
    except InjectedFailure as exc:
        return exc
    return None


def swap_within(engine: TorchEngine, version: int, model) -> bool:
    """Whether a swap to ``version`` returned (applied) within :data:`WAIT_S`."""
    outcome = {}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    thread = threading.Thread(target=lambda: outcome.update(result=engine.swap_weights(version, state)), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    return "result" in outcome and outcome["result"].applied


def serve_through_a_failure(engine: TorchEngine, model) -> tuple[list, list, bool]:
    """Two long requests that the trap fails, then one served after it, then a swap."""
    async def main():
        await engine.start()
        try:
            errors = await asyncio.gather(first_error(engine, long_request(0)), first_error(engine, long_request(1)))
            after = await asyncio.wait_for(
                collect(engine, GenerationRequest("after", [4, 5, 6], SamplingParams(max_tokens=5, seed=9))), WAIT_S)
            swapped = await asyncio.to_thread(swap_within, engine, 1, model)
            return list(errors), after, swapped
        finally:
            await engine.stop()  # joins the loop thread, which returns at once from a dead one

    return asyncio.run(main())


def test_a_failing_cache_selection_of_a_cancelled_row_fails_the_batch_and_the_loop_goes_on(model, kv_layout,
                                                                                            monkeypatch):
    def cancel_the_second_and_arm(engine: TorchEngine, select_trap: Trap) -> bool:
        # the next round's _drop_cancelled selects the rows before any model call, outside _guarded
        engine._rows[1].cancelled.set()
        select_trap.shots = 1
        return True

    engine = trapped_engine(model, kv_layout, monkeypatch, cancel_the_second_and_arm)
    errors, after, swapped = serve_through_a_failure(engine, model)
    assert all(isinstance(e, InjectedFailure) for e in errors), errors
    assert len(after) == 5 and after[-1].finish_reason == "length"
    assert swapped and engine.policy_version == 1
    assert engine.running == 0


def test_a_failing_cache_selection_after_a_failed_step_fails_the_batch_and_the_loop_goes_on(model, kv_layout,
                                                                                          monkeypatch):
    forward_trap = Trap()

    def fail_the_next_step_and_its_selection(engine: TorchEngine, select_trap: Trap) -> bool:
        forward_trap.shots = select_trap.shots = 1  # _guarded's except selects the rows the step did not fail
        return True

    engine = trapped_engine(model, kv_layout, monkeypatch, fail_the_next_step_and_its_selection)
    served = engine._model
    handle = served.register_forward_pre_hook(lambda module, args: forward_trap.fire("the model's forward"))
    try:
        errors, after, swapped = serve_through_a_failure(engine, served)
    finally:
        handle.remove()
    assert all(isinstance(e, InjectedFailure) for e in errors), errors
    assert len(after) == 5 and after[-1].finish_reason == "length"
    assert swapped and engine.policy_version == 1
    assert engine.running == 0


def test_a_step_callback_that_raises_is_logged_once_per_kind_and_the_loop_goes_on(model, kv_layout, caplog):
    """The ``on_step`` metrics callback raising after a weight switch killed the loop thread: the next
    switch never ran (its swap blocked) and no request was served again. After a model step, it failed the
    batch's requests (the step's guard took it for the model's failure)."""
    if kv_layout == "flat":  # it switches its model's attention function (grouped_attention.py)
        model = copy.deepcopy(model)
    called: list[str] = []

    def on_step(stats: StepStats) -> None:
        called.append(stats.kind)
        raise InjectedFailure(f"the metrics callback failed after a {stats.kind}")

    engine = TorchEngine(model, cfg=ServingConfig(kv_layout=kv_layout, max_batch_size=4), on_step=on_step)

    async def main():
        await engine.start()
        try:
            swapped = [await asyncio.to_thread(swap_within, engine, version, model) for version in (1, 2)]
            served = [await asyncio.wait_for(collect(engine, GenerationRequest(
                f"after{i}", [4, 5, 6], SamplingParams(max_tokens=5, seed=i))), WAIT_S) for i in range(2)]
            return swapped, served
        finally:
            await engine.stop()

    with caplog.at_level("ERROR", logger="serving.engine.torch_engine"):
        swapped, served = asyncio.run(main())
    assert swapped == [True, True] and engine.policy_version == 2
    assert [len(events) for events in served] == [5, 5] and served[-1][-1].finish_reason == "length"
    logged = [r.getMessage() for r in caplog.records if "on_step callback failed" in r.getMessage()]
    assert called.count("switch") == 2 and len(logged) == len(set(called))  # once per kind
    assert all(sum(f"after a {kind} step" in line for line in logged) == 1 for kind in set(called))
