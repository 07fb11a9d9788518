"""A load generator for the OpenAI-compatible endpoint: closed-loop clients over HTTP.

``clients`` simulated users each send one chat completion after another (plain or
streaming, chosen per request with ``stream_share``) through the official ``openai``
AsyncOpenAI client with its retries off, so every failure is seen and counted; a
share of answered interactions also gets a reward through ``POST /v1/feedback``, drawn in the
configured reward range (``LoadParams.reward_range``).
Prompts come from the project's prompt pool (:func:`apps.default_model.corpus.iter_prompts`).

Every request becomes a :class:`RequestRecord` (HTTP status, latency, interaction id,
the policy versions that sampled it; :mod:`apps.load.stats`); a request slower than
``request_timeout_s`` from send to its answer's last byte is abandoned as ``timeout``. A watcher
polls ``GET /v1/models`` to time the weight swaps; on its own stack, another one stops the
clients early once a process of the stack has exited. The run with its stack
and the check against Kafka live in :mod:`apps.load.run`; the JSON and the
plot in :mod:`apps.load.report`.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Callable

import httpx
import openai
from openai import AsyncOpenAI

from apps.load.stats import LoadParams, LoadResult, RequestRecord, VersionPoint, summarize, versions_text

NO_API_KEY = "unused"
"""The openai client insists on a key; a loopback endpoint accepts requests without one."""
POLL_TIMEOUT_S = 10.0
"""Timeout of one ``GET /v1/models`` of the version watcher."""
KEEPALIVE_EXPIRY_S = 5.0
"""Idle keep-alive connections are dropped by the client after this: httpx's default, as real
openai clients do. The server keeps idle connections for ``serving.keep_alive_s`` (65 s), longer,
so a request is never sent on a connection the server is closing. With the server at uvicorn's
default 5 s, two 30 s runs of 64 clients on 2 shared cores saw 9 and 1 connection resets
(ReadError) (docs/RELIABILITY.md, Load)."""
DETAIL_CHARS = 300
"""Longest failure detail kept per request."""
REWARD_DECIMALS = 3
"""Decimals of a reward sent: short request bodies, values still spread over the range."""
HALT_POLL_S = 1.0
"""Seconds between two calls of the ``halt`` callback (a look at the stack's processes, cheap): a
serving found dead stops the clients within this, not after the whole duration."""


def load_prompts() -> list[str]:
    """The project's prompt pool: every prompt of the corpus."""
    from apps.default_model.corpus import iter_prompts

    return [prompt for _, _, prompt in iter_prompts()]


def _extension(obj: object, name: str) -> object:
    return (getattr(obj, "model_extra", None) or {}).get(name)


def _detail(exc: BaseException) -> str:
    """The exception and its cause (the transport error under the client's wrapper), shortened."""
    text = f"{type(exc).__name__}: {exc}"
    if exc.__cause__ is not None:
        text += f" <- {type(exc.__cause__).__name__}: {exc.__cause__}"
    return text[:DETAIL_CHARS]


def _timed_out(timeout_s: float) -> str:
    return f"no whole answer within request_timeout_s ({timeout_s:g} s)"


def _served_version(body: Any, model: str) -> int:
    """The policy version ``GET /v1/models`` reports for ``model``; one of VERSION_POLL_FAILURES
    when the answer holds none."""
    return int(next(m["policy_version"] for m in body["data"] if m["id"] == model))


VERSION_POLL_FAILURES = (httpx.HTTPError, KeyError, StopIteration, ValueError, TypeError, OverflowError)
"""A look at /v1/models that gives no version: counted, the watcher goes on. TypeError is a body of
another shape (a list, null data or version) and OverflowError an infinite version: both killed the
watcher and with it the whole run, at its end."""


def _failure(exc: openai.APIError) -> tuple[int, str]:
    """(status, category) of a failed request."""
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code, str(exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return 0, "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return 0, "connection"
    body = exc.body if isinstance(exc.body, dict) else {}  # an error event inside a stream begun with 200
    return 200, f"stream:{body.get('type', 'unknown')}"


class LoadGenerator:
    """Drives one endpoint (``base_url`` without ``/v1``) with ``params``."""

    def __init__(self, base_url: str, api_key: str | None, params: LoadParams,
                 progress: Callable[[str], None] = print, prompts: list[str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 halt: Callable[[], str | None] | None = None) -> None:
        """``transport`` replaces the network (unit tests); by default requests go over TCP.
        ``halt`` is called every HALT_POLL_S during the load: a reason it returns (a process of the
        stack exited) stops the clients early (requests in flight end as they do) and is kept in
        the result's ``stopped_early``."""
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.transport = transport
        self.params = params
        self.progress = progress
        self.prompts = prompts or load_prompts()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.api_key = api_key or NO_API_KEY
        self.records: list[RequestRecord] = []
        self.versions: list[VersionPoint] = []
        self.version_poll_errors = 0
        self.halt = halt
        self.stopped_early: str | None = None
        self.stopped_at_s: float | None = None
        self._t0 = 0.0

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def run(self) -> LoadResult:
        p = self.params
        # a connection per client for chat and one for its feedback: none waits for the pool
        limits = httpx.Limits(max_connections=2 * p.clients + 2, max_keepalive_connections=2 * p.clients + 2,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=p.request_timeout_s,
                                 limits=limits, transport=self.transport)
        client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0,
                             timeout=p.request_timeout_s, http_client=http)
        started_at = time.time()
        self._t0 = time.monotonic()
        done = asyncio.Event()
        watchers = [asyncio.create_task(self._watch_versions(http, done)),
                    asyncio.create_task(self._report_progress(done))]
        if self.halt is not None:
            watchers.append(asyncio.create_task(self._watch_halt(self.halt, done)))
        try:
            await asyncio.gather(*(self._client(i, client, http) for i in range(p.clients)))
            # the load's span ends with the clients: a version poll still in flight (up to
            # POLL_TIMEOUT_S) lengthened it and lowered the reported throughput
            wall_s = self._now()
        finally:
            done.set()
            await asyncio.gather(*watchers)
            await http.aclose()
        self.progress(self._progress_line(final=True, now=wall_s))
        return LoadResult(p, self.base_url, started_at, wall_s, list(self.records), list(self.versions),
                          self.version_poll_errors, self.stopped_early, self.stopped_at_s)

    async def _client(self, index: int, client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        p = self.params
        rng = random.Random(f"{p.seed}:{index}")
        sent = 0
        while (self._now() < p.duration_s and self.stopped_early is None
               and (p.requests_per_client is None or sent < p.requests_per_client)):
            sent += 1
            prompt = rng.choice(self.prompts)
            stream = rng.random() < p.stream_share
            record = await (self._stream(index, client, prompt) if stream else self._plain(index, client, prompt))
            self.records.append(record)
            if not record.ok:
                await asyncio.sleep(p.failure_pause_s)
            elif rng.random() < p.feedback_share:
                self.records.append(await self._feedback(index, http, record.interaction_id or "", rng))

    async def _plain(self, index: int, client: AsyncOpenAI, prompt: str) -> RequestRecord:
        start = self._now()
        timeout_s = self.params.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # the client's own timeouts bound each read, not the whole
                reply = await client.chat.completions.create(
                    model=self.params.model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.params.max_tokens, temperature=self.params.temperature)
        except TimeoutError:
            return RequestRecord("chat", index, start, self._now() - start, 0, "timeout", detail=_timed_out(timeout_s))
        except openai.APIError as exc:
            status, error = _failure(exc)
            return RequestRecord("chat", index, start, self._now() - start, status, error, detail=_detail(exc))
        iid = _extension(reply, "interaction_id")
        iid = iid if isinstance(iid, str) and iid else None
        versions = tuple(_extension(reply, "policy_versions") or ())
        tokens = reply.usage.completion_tokens if reply.usage else 0
        finished = bool(reply.choices) and reply.choices[0].finish_reason is not None
        error = None if iid and finished else "incomplete"
        return RequestRecord("chat", index, start, self._now() - start, 200, error, iid, versions, tokens)

    async def _stream(self, index: int, client: AsyncOpenAI, prompt: str) -> RequestRecord:
        start = self._now()
        timeout_s = self.params.request_timeout_s
        iid, versions, tokens, ttft, finished, status = None, (), 0, None, False, 0
        try:
            # the client's timeout bounds each read of a stream: one that keeps trickling events
            # went on past request_timeout_s and was never counted as a timeout
            async with asyncio.timeout(timeout_s):
                events = await client.chat.completions.create(
                    model=self.params.model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.params.max_tokens, temperature=self.params.temperature, stream=True,
                    stream_options={"include_usage": True})
                status = 200
                async with events:  # the response is closed however the reading ends, a timeout included
                    async for chunk in events:
                        iid = _extension(chunk, "interaction_id") or iid
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                        for choice in chunk.choices:
                            if ttft is None and choice.delta.content:
                                ttft = self._now() - start
                            if choice.finish_reason is not None:
                                finished = True
                                versions = tuple(_extension(chunk, "policy_versions") or ())
        except TimeoutError:
            return RequestRecord("stream", index, start, self._now() - start, status, "timeout",
                                 iid if isinstance(iid, str) else None, versions, tokens, ttft, _timed_out(timeout_s))
        except openai.APIError as exc:
            status, error = _failure(exc)
            return RequestRecord("stream", index, start, self._now() - start, status, error,
                                 iid if isinstance(iid, str) else None, versions, tokens, ttft, _detail(exc))
        error = None if finished and isinstance(iid, str) and iid else "incomplete"
        return RequestRecord("stream", index, start, self._now() - start, 200, error,
                             iid if isinstance(iid, str) else None, versions, tokens, ttft)

    def _reward(self, rng: random.Random) -> float:
        """A reward drawn uniformly in ``params.reward_range``, rounded to REWARD_DECIMALS (kept inside
        the range: rounding could step past a bound serving checks)."""
        low, high = self.params.reward_range
        return min(high, max(low, round(rng.uniform(low, high), REWARD_DECIMALS)))

    async def _feedback(self, index: int, http: httpx.AsyncClient, interaction_id: str,
                        rng: random.Random) -> RequestRecord:
        start = self._now()
        body = {"interaction_id": interaction_id, "reward": self._reward(rng), "source": "load"}
        try:
            async with asyncio.timeout(self.params.request_timeout_s):  # as a chat request's
                reply = await http.post("/v1/feedback", json=body)
        except TimeoutError:
            return RequestRecord("feedback", index, start, self._now() - start, 0, "timeout", interaction_id,
                                 detail=_timed_out(self.params.request_timeout_s))
        except httpx.TransportError as exc:
            error = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
            return RequestRecord("feedback", index, start, self._now() - start, 0, error, interaction_id,
                                 detail=_detail(exc))
        if reply.status_code == 200:
            return RequestRecord("feedback", index, start, self._now() - start, 200, None, interaction_id)
        return RequestRecord("feedback", index, start, self._now() - start, reply.status_code,
                             str(reply.status_code), interaction_id, detail=reply.text[:DETAIL_CHARS])

    async def _watch_versions(self, http: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            try:
                reply = await http.get("/v1/models", timeout=POLL_TIMEOUT_S)
                reply.raise_for_status()
                version = _served_version(reply.json(), self.params.model)
            except VERSION_POLL_FAILURES:
                self.version_poll_errors += 1
            else:
                if not self.versions or self.versions[-1].version != version:
                    self.versions.append(VersionPoint(round(self._now(), 3), version))
            try:
                await asyncio.wait_for(done.wait(), self.params.version_poll_s)
            except asyncio.TimeoutError:
                pass

    async def _watch_halt(self, halt: Callable[[], str | None], done: asyncio.Event) -> None:
        """Ask ``halt`` every HALT_POLL_S until the clients are done; its first reason stops them."""
        while not done.is_set():
            reason = halt()
            if reason is not None:
                self.stopped_early, self.stopped_at_s = reason, round(self._now(), 3)
                self.progress(f"load stopped early at {self.stopped_at_s:.0f} s: {reason}")
                return
            try:
                await asyncio.wait_for(done.wait(), HALT_POLL_S)
            except asyncio.TimeoutError:
                pass

    async def _report_progress(self, done: asyncio.Event) -> None:
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), self.params.progress_every_s)
            except asyncio.TimeoutError:
                self.progress(self._progress_line())

    def _progress_line(self, final: bool = False, now: float | None = None) -> str:
        now = self._now() if now is None else now
        s = summarize(self.records, max(now, 1e-9), self.versions)
        served = self.versions[-1].version if self.versions else "?"
        p50 = f"{s.latency_p50_s:.2f}" if s.latency_p50_s is not None else "-"
        p99 = f"{s.latency_p99_s:.2f}" if s.latency_p99_s is not None else "-"
        head = "load done" if final else "load"
        return (f"[{head} {now:5.0f}/{self.params.duration_s:.0f} s] {s.answered} answered "
                f"({s.throughput_rps:.1f} req/s, {s.tokens_per_s:.0f} tok/s), p50 {p50} s p99 {p99} s, "
                f"errors {sum(s.errors.values())} (5xx {s.server_errors}), feedback {s.feedback_ok}, "
                f"serving v{served}, versions seen {versions_text(s.versions_seen)}")


def run_load(base_url: str, api_key: str | None, params: LoadParams,
             progress: Callable[[str], None] = print, halt: Callable[[], str | None] | None = None) -> LoadResult:
    """Run the load to completion, or until ``halt`` gives a reason (blocking)."""
    return asyncio.run(LoadGenerator(base_url, api_key, params, progress, halt=halt).run())
