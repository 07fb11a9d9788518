"""The generator worker: serving's TorchEngine (continuous batching) answering the
benchmark's requests, following the versions the learner publishes.

* sync: submit one batch of ``groups_per_batch`` groups of ``group_size`` requests,
  wait for all of them, wait until the learner has trained on them, switch to the
  newest version, repeat.
* stream: ``concurrency`` requests in flight at all times (the next starts when
  one ends), the engine switches to each new version as it is published
  (between two decode steps, as serving does), and no request starts while
  ``max_untrained`` submitted rollouts wait to be trained (backpressure).

Every request asks for exactly its drawn length (``max_tokens`` = length, no
stop token ids) and is sent to the learner as an
:class:`~online_sao.schemas.Interaction`, as serving logs it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from online_sao.config import ServingConfig
from apps.default_model.corpus import iter_prompts
from online_sao.modeling import load_policy, load_tokenizer
from online_sao.schemas import Interaction, SamplingParams
from online_sao.weights import FileWeightStore
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import StepStats, TorchEngine

from benchmarks.straggler.channels import GET_TIMEOUT_S, Channels, drain, get_or_none
from benchmarks.straggler.spec import (EngineStep, Finished, GeneratorReport, LoopSpec, Published, request_seed,
                                       response_length)

WARMUP_TOKENS = 4
"""Tokens of the one request that warms the engine up before the loop's clock starts."""
STOP_POLL_S = 0.01
"""How often the request loop looks at the stop flag."""
BACKPRESSURE_POLL_S = 0.01
"""How often a held-back streaming request looks again at the learner's progress."""


def chat_prompts(tokenizer) -> list[list[int]]:
    """The corpus prompts in the chat template, as serving would see them."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for _, _, p in iter_prompts()]


class VersionFollower:
    """Reads this loop's :class:`Published` messages: keeps the learner's trained
    count and the newest version, and switches the engine to it (at once when
    ``swap_at_once``, else when :meth:`apply_latest` is called)."""

    def __init__(self, engine: TorchEngine, store: FileWeightStore, ch: Channels, loop: int, swap_at_once: bool):
        self.engine, self.store, self.ch, self.loop, self.swap_at_once = engine, store, ch, loop, swap_at_once
        self.trained = 0
        self.swaps = 0
        self._latest: Published | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="version-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while not self.ch.stop.is_set():
            first = get_or_none(self.ch.weights)
            mine = [m for m in ([first] if first else []) + drain(self.ch.weights) if m.loop == self.loop]
            if not mine:
                continue
            with self._cond:
                self._latest = mine[-1]
                self.trained = mine[-1].trained
                self._cond.notify_all()
            if self.swap_at_once:
                self.apply_latest()

    def wait_trained(self, count: int) -> bool:
        """Block until the learner has trained ``count`` rollouts; False if the loop stopped first."""
        with self._cond:
            while self.trained < count:
                if self.ch.stop.is_set():
                    return False
                self._cond.wait(GET_TIMEOUT_S)
            return True

    def apply_latest(self) -> None:
        latest = self._latest
        if latest is None or latest.version <= self.engine.policy_version:
            return
        try:
            state = self.store.load(latest.location, latest.checksum)
        except FileNotFoundError:
            return  # pruned by the learner meanwhile: a newer version has been announced
        if self.engine.swap_weights(latest.version, state).applied:
            self.swaps += 1


class Requests:
    """Runs request ``index`` on the engine and hands its interaction to the learner."""

    def __init__(self, spec: LoopSpec, loop: int, prompts: list[list[int]], engine: TorchEngine, ch: Channels):
        self.spec, self.loop, self.prompts, self.engine, self.ch = spec, loop, prompts, engine, ch
        self.submitted = 0
        self.generated: dict[int, tuple[int, int]] = {}

    async def run(self, index: int) -> None:
        self.submitted += 1
        prompt = self.prompts[(index // self.spec.group_size) % len(self.prompts)]
        planned = response_length(self.spec, index)
        sampling = SamplingParams(temperature=1.0, max_tokens=planned, seed=request_seed(self.spec, index))
        request = GenerationRequest(f"loop{self.loop}-{index}", prompt, sampling)  # no stop ids: `planned` tokens
        events = [event async for event in self.engine.generate(request)]
        interaction = Interaction(
            interaction_id=request.request_id, model="straggler-bench", prompt_ids=prompt,
            response_ids=[e.token_id for e in events], action_mask=[True] * len(events),
            logprobs=[min(e.logprob, 0.0) for e in events], versions=[e.version for e in events],
            sampling=sampling, finish_reason=events[-1].finish_reason or "length")
        self.generated[index] = (planned, len(events))
        self.ch.rollouts.put(Finished(self.loop, index, planned, interaction))


async def until_done_or_stopped(ch: Channels, tasks: list[asyncio.Task]) -> None:
    """Wait until every task ended or the loop stopped (then cancel the rest); a task's error is raised."""
    while not ch.stop.is_set() and not all(t.done() for t in tasks):
        await asyncio.sleep(STOP_POLL_S)
    for task in tasks:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
    if errors:
        raise errors[0]


async def sync_loop(spec: LoopSpec, requests: Requests, follower: VersionFollower, ch: Channels) -> None:
    size = spec.batch_requests
    for batch in itertools.count():
        tasks = [asyncio.create_task(requests.run(i)) for i in range(batch * size, (batch + 1) * size)]
        await until_done_or_stopped(ch, tasks)
        if ch.stop.is_set() or not await asyncio.to_thread(follower.wait_trained, (batch + 1) * size):
            return
        await asyncio.to_thread(follower.apply_latest)


async def stream_loop(spec: LoopSpec, requests: Requests, follower: VersionFollower, ch: Channels) -> None:
    indices = itertools.count()

    async def client() -> None:
        while not ch.stop.is_set():
            if requests.submitted - follower.trained >= spec.max_untrained:
                await asyncio.sleep(BACKPRESSURE_POLL_S)
                continue
            await requests.run(next(indices))

    await until_done_or_stopped(ch, [asyncio.create_task(client()) for _ in range(spec.concurrency)])


async def serve(loop: int, spec: LoopSpec, ch: Channels) -> GeneratorReport:
    model = load_policy(spec.model_dir)
    prompts = chat_prompts(load_tokenizer(spec.model_dir))
    room = model.config.max_position_embeddings - max(len(p) for p in prompts)
    if spec.max_tokens > room:
        raise ValueError(f"max_tokens {spec.max_tokens} does not fit: the longest prompt leaves {room} positions")
    steps: list[EngineStep] = []

    def on_step(s: StepStats) -> None:
        steps.append(EngineStep(s.ended_at - s.seconds, s.ended_at, s.kind, s.batch_size))

    serving = ServingConfig(max_batch_size=spec.max_batch_size, kv_layout=spec.kv_layout, compile=spec.engine_compile)
    engine = TorchEngine(model, cfg=serving, on_step=on_step)
    await engine.start()
    try:
        warmup = GenerationRequest("warm-up", prompts[0], SamplingParams(max_tokens=WARMUP_TOKENS, seed=0))
        [_ async for _ in engine.generate(warmup)]
        steps.clear()
        follower = VersionFollower(engine, FileWeightStore(spec.weights_dir), ch, loop, spec.mode == "stream")
        requests = Requests(spec, loop, prompts, engine, ch)
        ch.results.put(("ready", "generator", loop, None))
        start = await asyncio.to_thread(ch.go("generator").get)
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        cpu_start = time.process_time()
        follower.start()
        await (sync_loop if spec.mode == "sync" else stream_loop)(spec, requests, follower, ch)
        cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - start
        follower.join()
    finally:
        await engine.stop()
    return GeneratorReport(list(steps), dict(requests.generated), follower.swaps, cpu_s, wall_s)


def run_generator(loop: int, spec: LoopSpec, ch: Channels) -> GeneratorReport:
    return asyncio.run(serve(loop, spec, ch))
