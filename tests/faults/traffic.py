"""The fault suite's traffic driver: clients of the official ``openai`` client, and their rewards.

See :class:`Traffic` (documented with the rest of the harness in :mod:`tests.faults.harness`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MODEL_NAME = "online-sao"
POLL_S = 0.2
"""Pause between polls of the ledger, a process or the traffic's progress (no busy wait)."""
CLIENT_TIMEOUT_S = 60.0
"""One HTTP request of the traffic driver (generation on a loaded machine included)."""
CONNECT_RETRY_S = 0.5
"""Extra pause of a traffic worker after the server could not be reached (it is down)."""
FEEDBACK_RETRY_S = 0.5
"""Pause between rounds of delivering owed rewards when ``stop`` drains them."""


class TrafficError(AssertionError):
    """The traffic did not reach what a scenario waited for."""


@dataclass
class Traffic:
    """See :mod:`tests.faults.harness` (the harness API, documented in one place)."""

    base_url: str
    workers: int = 2
    stream_every: int = 2
    """Worker i streams when i % stream_every == stream_every - 1 (0: nobody streams)."""
    max_tokens: int = 8
    pause_s: float = 1.0
    """Pause of a worker between two requests (keeps the rate small on two cores)."""
    acked: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    refusals: list[str] = field(default_factory=list)
    events: list[tuple[float, int | str]] = field(default_factory=list)
    unrewarded: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from openai import OpenAI

        self._client = OpenAI(base_url=f"{self.base_url}/v1", api_key="not-needed-on-loopback", max_retries=0,
                              timeout=CLIENT_TIMEOUT_S)
        self._http = httpx.Client(base_url=self.base_url, timeout=CLIENT_TIMEOUT_S)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rewards: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"traffic-{i}", daemon=True)
                         for i in range(self.workers)]

    def start(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def stop(self, drain_s: float = 120.0) -> None:
        """Stop sending requests; keep delivering owed rewards for up to ``drain_s``."""
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT_S + 5)
        deadline = time.monotonic() + drain_s
        while self._send_owed_rewards() and time.monotonic() < deadline:
            time.sleep(FEEDBACK_RETRY_S)
        with self._lock:
            self.unrewarded = list(self._rewards)
        self._http.close()

    def count(self, status: int | str) -> int:
        with self._lock:
            return self.statuses[status]

    def wait_for(self, predicate, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TrafficError(f"traffic condition not met within {timeout_s:.0f} s; statuses {self.statuses}")
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ workers

    def _note(self, status: int | str, message: str | None = None, acked: str | None = None) -> None:
        with self._lock:
            self.statuses[status] += 1
            self.events.append((time.monotonic(), status))
            if message is not None:
                self.refusals.append(message)
            if acked is not None:
                self.acked.append(acked)
                self._rewards.append(acked)

    def _run(self, worker: int) -> None:
        import openai

        stream = self.stream_every > 0 and worker % self.stream_every == self.stream_every - 1
        n = 0
        while not self._stop.is_set():
            messages = [{"role": "user", "content": f"worker {worker} asks question {n}"}]
            try:
                iid = self._chat_stream(messages) if stream else self._chat(messages)
                self._note(200 if iid else "incomplete_stream", acked=iid)
            except openai.APIStatusError as exc:
                self._note(exc.status_code, message=str(exc))
            except (openai.APIConnectionError, httpx.HTTPError):  # timeouts included
                self._note("connection_error")
                self._stop.wait(CONNECT_RETRY_S)
            except openai.APIError as exc:  # an error event inside a stream that had begun (its 503)
                self._note("stream_error", message=str(exc))
            self._send_owed_rewards()
            n += 1
            self._stop.wait(self.pause_s)

    def _chat(self, messages: list[dict]) -> str:
        reply = self._client.chat.completions.create(model=MODEL_NAME, max_tokens=self.max_tokens, messages=messages)
        return reply.model_extra["interaction_id"]

    def _chat_stream(self, messages: list[dict]) -> str | None:
        """The id once the final chunk (with finish_reason) arrived; None when the stream broke off."""
        iid, finished = None, False
        with self._client.chat.completions.create(model=MODEL_NAME, max_tokens=self.max_tokens, messages=messages,
                                                  stream=True) as chunks:
            for chunk in chunks:
                extra = chunk.model_extra or {}
                iid = extra.get("interaction_id", iid)
                finished = finished or any(c.finish_reason for c in chunk.choices)
        return iid if finished else None

    def _send_owed_rewards(self) -> bool:
        """Deliver owed rewards; True while some are still owed."""
        with self._lock:
            owed, self._rewards = self._rewards, []
        failed = []
        for iid in owed:
            try:
                response = self._http.post("/v1/feedback", json={"interaction_id": iid, "reward": _reward(iid),
                                                                 "source": "fault-harness"})
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                failed.append(iid)
        with self._lock:
            self._rewards = failed + self._rewards
            return bool(self._rewards)


def _reward(interaction_id: str) -> float:
    """A deterministic reward in [-1, 1] per id (its value does not matter to the checks)."""
    return int(hashlib.sha256(interaction_id.encode()).hexdigest()[:4], 16) / 0x7FFF - 1.0
