"""Simulated users: chat requests to an OpenAI-compatible endpoint, from a prompt pool, at a rate.

:class:`SimulatedUsers` is a client like any other (the official ``openai`` package over
HTTP). Requests start as a Poisson process of rate ``experiment.requests_per_second``
(seeded by ``experiment.seed``) with at most ``experiment.concurrency`` in flight;
prompts are drawn from the pool in an order seeded by ``experiment.prompt_seed``,
each sent ``repeats`` times in a row (grpo's groups); with ``experiment.segments`` each
request draws its user segment (scenario.segment_draws) and sends it as the OpenAI ``user``
field. The endpoint's extension field
``interaction_id`` is read from the response; every answer is handed to
``on_response``. :func:`measure_style_accuracy` answers held-out prompts with
``session_id = experiment.eval_session_id`` (the judge skips those) and classifies them;
:func:`drive_arm` combines both for one arm (the judge, a separate service, records rewards).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
from openai import AsyncOpenAI

from apps.config import AppConfig, ExperimentConfig
from apps.experiments.results import EvalRow, append_row
from apps.experiments.scenario import (arrival_gaps, eval_prompts, prompt_order, prompt_pool, prompt_repeats,
                                      segment_draws)
from apps.experiments.style import StyleClassifier

MAX_CONSECUTIVE_FAILURES = 20
"""Requests failing in a row (after the client's own retries) that end the run: the endpoint is down."""
NO_API_KEY = "unused"
"""The openai client insists on a key; a loopback endpoint accepts requests without one."""


@dataclass(frozen=True)
class SimResponse:
    index: int
    """Order in which the request was sent (0-based)."""
    prompt: str
    text: str
    interaction_id: str
    policy_version: int | None
    finish_reason: str | None
    latency_s: float
    segment: str | None = None
    """The user segment the request was sent as (None without segments)."""


@dataclass
class SimStats:
    sent: int = 0
    answered: int = 0
    failed: int = 0
    wall_s: float = 0.0


OnResponse = Callable[[SimResponse], "None | Awaitable[None]"]


def _extension(response: object, name: str) -> object:
    extra = getattr(response, "model_extra", None) or {}
    return extra.get(name)


async def chat_once(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, temperature: float,
                    session_id: str | None = None, user: str | None = None) -> tuple[str, str, int | None, str | None]:
    """(answer text, interaction id, policy version, finish reason) of one chat request; ``user``
    goes in the OpenAI ``user`` field when given."""
    extra = {"session_id": session_id} if session_id is not None else None
    optional = {"user": user} if user is not None else {}
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, extra_body=extra, **optional)
    interaction_id = _extension(response, "interaction_id")
    if not isinstance(interaction_id, str) or not interaction_id:
        raise ValueError(f"the endpoint's response carries no interaction_id: {response!r}")
    version = _extension(response, "policy_version")
    choice = response.choices[0]
    return choice.message.content or "", interaction_id, version, choice.finish_reason


class SimulatedUsers:
    def __init__(self, base_url: str, api_key: str | None, scenario: ExperimentConfig, prompts: list[str],
                 on_response: OnResponse | None = None, model: str = "online-sao", repeats: int = 1,
                 client: AsyncOpenAI | None = None, check_alive: Callable[[], None] | None = None) -> None:
        if not prompts:
            raise ValueError("the prompt pool is empty")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.scenario = scenario
        self.prompts = prompts
        self.on_response = on_response
        self.model = model
        self.repeats = repeats
        self.client = client or AsyncOpenAI(base_url=base_url, api_key=api_key or NO_API_KEY)
        self.check_alive = check_alive
        self.stats = SimStats()

    def prompt_order(self) -> Iterator[str]:
        """Endless prompts: a seeded shuffle of the pool per pass, each prompt ``repeats`` times."""
        return prompt_order(self.prompts, self.scenario.prompt_seed, self.repeats)

    async def run(self, total: int | None = None) -> SimStats:
        """Send requests until ``total`` (default ``rollouts_per_arm``) were answered.

        A request the endpoint refuses (after the client's retries) is counted and
        replaced; MAX_CONSECUTIVE_FAILURES in a row raise. Errors of ``on_response`` raise.
        ``check_alive``, when given, runs before every request is sent and after every request
        ends, answered or failed, and raises when a process of the stack has exited: when serving
        dies mid-traffic every request fails, and its error (the process, its exit status, its log's
        tail) is what ends the run, not a RuntimeError that says only that requests failed.
        """
        total = self.scenario.rollouts_per_arm if total is None else total
        gaps = arrival_gaps(self.scenario.seed, self.scenario.requests_per_second)
        prompts = self.prompt_order()
        segments = segment_draws(self.scenario)
        tasks: set[asyncio.Task] = set()
        failures_in_row = 0
        last_error: openai.APIError | None = None
        started = time.monotonic()

        async def one(index: int, prompt: str, segment: str | None) -> None:
            nonlocal failures_in_row, last_error
            t0 = time.monotonic()
            try:
                text, iid, version, finish = await chat_once(self.client, self.model, prompt,
                                                             self.scenario.max_tokens, self.scenario.temperature,
                                                             user=segment)
            except openai.APIError as exc:
                self.stats.failed += 1
                failures_in_row += 1
                last_error = exc
                return
            self.stats.answered += 1
            failures_in_row = 0
            if self.on_response is not None:
                result = self.on_response(SimResponse(index, prompt, text, iid, version, finish,
                                                      time.monotonic() - t0, segment))
                if inspect.isawaitable(result):
                    await result

        try:
            while self.stats.answered < total:
                if self.check_alive is not None:
                    self.check_alive()
                for task in [t for t in tasks if t.done()]:
                    tasks.discard(task)
                    task.result()
                if failures_in_row >= MAX_CONSECUTIVE_FAILURES:
                    raise RuntimeError(f"{failures_in_row} requests failed in a row; last error: {last_error}")
                if self.stats.answered + len(tasks) < total and len(tasks) < self.scenario.concurrency:
                    await asyncio.sleep(next(gaps))
                    tasks.add(asyncio.create_task(one(self.stats.sent, next(prompts), next(segments))))
                    self.stats.sent += 1
                    continue
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            await asyncio.gather(*tasks)  # callbacks of the last answers
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            self.stats.wall_s = time.monotonic() - started
        return self.stats

    async def close(self) -> None:
        await self.client.close()


async def measure_style_accuracy(client: AsyncOpenAI, model: str, prompts: list[str], preferred: str,
                                 classifier: StyleClassifier, scenario: ExperimentConfig) -> tuple[float, int | None]:
    """(share of answers to ``prompts`` in ``preferred`` style, newest policy version seen)."""
    slots = asyncio.Semaphore(scenario.concurrency)

    async def ask(prompt: str) -> tuple[str, int | None]:
        async with slots:
            text, _, version, _ = await chat_once(client, model, prompt, scenario.max_tokens,
                                                  scenario.temperature, session_id=scenario.eval_session_id)
            return text, version

    answers = await asyncio.gather(*(ask(p) for p in prompts))
    accuracy = classifier.accuracy([text for text, _ in answers], [preferred] * len(answers))
    versions = [v for _, v in answers if v is not None]
    return accuracy, max(versions, default=None)


async def drive_arm(cfg: AppConfig, base_url: str, api_key: str | None, classifier: StyleClassifier,
                    results_path: Path, progress: Callable[[str], None] = print,
                    check_alive: Callable[[], None] | None = None) -> SimStats:
    """The client side of one arm: ``rollouts_per_arm`` simulated requests, and held-out style
    accuracy (EvalRow in ``results_path``) before the first and after every ``eval_every`` answers.
    ``check_alive`` raises when a process of the stack has exited (traffic to a policy whose learner
    is gone measures nothing); it runs around every request (SimulatedUsers.run), after every answer
    and when a measurement fails, so a dead serving is reported as itself, not as the requests it
    refused.

    ``cfg`` is the arm's configuration (scenario.arm_config); grpo arms repeat prompts in groups.
    """
    exp = cfg.experiment
    model = cfg.serving.model_name
    evals = eval_prompts(exp, cfg.model.base.seed)
    answered = 0

    async def measure(rollout: int) -> None:
        preferred = exp.preferred_style(rollout)
        try:
            accuracy, version = await measure_style_accuracy(users.client, model, evals, preferred, classifier,
                                                             exp)
        except openai.APIError:
            if check_alive is not None:
                check_alive()  # a process of the stack has exited: that is the error to report
            raise
        append_row(results_path, EvalRow(rollout=rollout, t=time.time(), version=version or 0,
                                         style_accuracy=accuracy, preferred=preferred, prompts=len(evals)))
        progress(f"rollout {rollout}/{exp.rollouts_per_arm}: {accuracy:.0%} of held-out answers {preferred} "
                 f"(policy v{version})")

    async def on_response(response: SimResponse) -> None:
        nonlocal answered
        answered += 1
        if check_alive is not None:
            check_alive()  # before a measurement too, which runs here, ahead of run()'s next look
        if answered % exp.eval_every == 0 or answered == exp.rollouts_per_arm:
            await measure(answered)

    users = SimulatedUsers(base_url, api_key, exp, prompt_pool(exp, cfg.model.base.seed), on_response,
                           model=model, repeats=prompt_repeats(cfg), check_alive=check_alive)
    try:
        await measure(0)
        return await users.run()
    finally:
        await users.close()
