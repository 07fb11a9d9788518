"""Data of a load run and its figures: parameters, one record per request, the summary.

Pure data and arithmetic (no HTTP): :mod:`apps.load.gen` fills the records,
:func:`summarize` turns them into throughput, latency percentiles, error counts by
status and the policy versions seen.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

SERVER_ERROR_TYPES = frozenset({"server_error", "service_unavailable", "timeout_error"})
"""Error types of a mid-stream error event that count as a 5xx (the status line said 200): a 500, a
503, and serving's deadline (a 504 on a plain request; serving/protocol.py)."""

Kind = Literal["chat", "stream", "feedback"]


@dataclass(frozen=True)
class LoadParams:
    """What the load generator sends."""

    clients: int = 64
    """Concurrent closed-loop clients (each sends its next request when the last one ended)."""
    duration_s: float = 300.0
    """Clients start new requests for this long; requests in flight then finish."""
    requests_per_client: int | None = None
    """A client also stops after this many chat requests (a fixed amount of work); None: only
    ``duration_s`` ends the run."""
    max_tokens: int = 32
    """max_tokens of every chat request."""
    temperature: float = 1.0
    """Sampling temperature of every chat request."""
    stream_share: float = 0.5
    """Share of chat requests sent with ``stream=True``."""
    feedback_share: float = 0.5
    """Share of answered interactions that get a reward through /v1/feedback."""
    request_timeout_s: float = 300.0
    """Client timeout of one request, from sending it to the end of its answer (a stream's last
    event included): a request slower than this is abandoned and counted as ``timeout``."""
    failure_pause_s: float = 0.5
    """A client waits this long after a failed request, so that a server that is down is not
    hammered in a tight loop (the failure is recorded all the same)."""
    progress_every_s: float = 10.0
    """Seconds between two progress lines."""
    version_poll_s: float = 1.0
    """Seconds between two looks at the served policy version (swap times)."""
    seed: int = 0
    """Seed of prompt, kind, feedback and reward choices (per client)."""
    reward_range: tuple[float, float] = (-1.0, 1.0)
    """(low, high): rewards are drawn uniformly in it. ``online-sao load`` gives the configuration's
    ``reward.min_value``, ``reward.max_value``, those serving accepts: a fixed [-1, 1] under a 0..1
    range had every negative reward refused (422) and the run FAILED though serving behaved."""
    model: str = "online-sao"
    """Model name sent in requests."""

    def __post_init__(self) -> None:
        # `requests_per_client or 1` let 0 through: every client stopped before its first request
        no_requests = self.requests_per_client is not None and self.requests_per_client < 1
        if self.clients < 1 or not _finite_above_zero(self.duration_s) or self.max_tokens < 1 or no_requests:
            raise ValueError("clients, duration_s, max_tokens and requests_per_client must be positive "
                             "(and duration_s finite)")
        if not (0.0 <= self.stream_share <= 1.0 and 0.0 <= self.feedback_share <= 1.0):
            raise ValueError("stream_share and feedback_share must lie in [0, 1]")
        intervals = (self.request_timeout_s, self.progress_every_s, self.version_poll_s)
        if not all(map(_finite_above_zero, intervals)) or not 0 <= self.failure_pause_s < math.inf:
            raise ValueError("timeouts and intervals must be finite and positive (failure_pause_s may be 0)")
        low, high = self.reward_range
        if not -math.inf < low < high < math.inf:  # NaN fails too
            raise ValueError(f"reward_range must be two finite numbers, low below high, got {self.reward_range}")


def _finite_above_zero(value: float) -> bool:
    """NaN fails every comparison, so ``value <= 0`` let it through (as it did infinity)."""
    return 0 < value < math.inf


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it."""

    kind: Kind
    client: int
    """Index of the client that sent it."""
    start_s: float
    """When it was sent, in seconds since the run started."""
    latency_s: float
    """Until the whole answer arrived (the last event of a stream)."""
    status: int
    """HTTP status; 0 when none arrived (timeout, connection failure)."""
    error: str | None = None
    """None when it succeeded, else its category: the status, ``timeout``, ``connection``,
    ``stream:<error type>`` (an error event after a 200) or ``incomplete`` (no final answer)."""
    interaction_id: str | None = None
    """The id the answer carried (for feedback: the id rewarded)."""
    policy_versions: tuple[int, ...] = ()
    """Versions that sampled the answer's tokens, as the answer reported them."""
    completion_tokens: int = 0
    """Sampled tokens, from the answer's usage."""
    ttft_s: float | None = None
    """Time to the first content chunk of a stream."""
    detail: str | None = None
    """What the client library said about a failure (exception type and message)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s

    @property
    def server_error(self) -> bool:
        """A 5xx, or an error event of a server error type inside a 200 stream."""
        if self.status >= 500:
            return True
        return self.error is not None and self.error.startswith("stream:") and \
            self.error.removeprefix("stream:") in SERVER_ERROR_TYPES


@dataclass(frozen=True)
class VersionPoint:
    t_s: float
    version: int


@dataclass
class LoadResult:
    params: LoadParams
    url: str
    started_at: float
    """Unix time of the start."""
    wall_s: float
    records: list[RequestRecord]
    versions: list[VersionPoint]
    """The served version each time it changed (and first), from GET /v1/models."""
    version_poll_errors: int = 0
    """Looks at /v1/models that failed or gave no version of the model."""
    stopped_early: str | None = None
    """Why the clients stopped before ``params.duration_s`` (a process of the run's stack exited);
    None when the run went its course."""
    stopped_at_s: float | None = None
    """When they stopped sending then, in seconds since the start."""


@dataclass(frozen=True)
class LoadSummary:
    wall_s: float
    requests: int
    """Chat requests sent (plain and streaming)."""
    answered: int
    throughput_rps: float
    """Answered chat requests per second of wall time."""
    tokens_per_s: float
    """Completion tokens of answered requests per second of wall time."""
    latency_p50_s: float | None
    latency_p99_s: float | None
    latency_max_s: float | None
    ttft_p50_s: float | None
    """Time to first token of answered streams."""
    errors: dict[str, int]
    """Failed requests (chat and feedback) by category."""
    server_errors: int
    """5xx answers, including server errors inside streams."""
    feedback_sent: int
    feedback_ok: int
    versions_seen: list[int]
    """Policy versions that sampled tokens of answered requests."""
    version_first_seen_s: dict[int, float]
    """When an answer carrying each version first ended (seconds since start)."""
    answers_across_swap: int
    """Answered requests sampled by more than one version (a swap between decode steps)."""
    swaps_observed: int
    """Changes of the served version seen by the watcher during the run."""


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the two closest ranks; None when empty."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(records: list[RequestRecord], wall_s: float, versions: list[VersionPoint]) -> LoadSummary:
    """Figures of a run from its records (``wall_s`` > 0)."""
    chats = [r for r in records if r.kind != "feedback"]
    answered = [r for r in chats if r.ok]
    feedback = [r for r in records if r.kind == "feedback"]
    latencies = [r.latency_s for r in answered]
    first_seen: dict[int, float] = {}
    for r in sorted(answered, key=lambda r: r.end_s):
        for v in r.policy_versions:
            first_seen.setdefault(v, r.end_s)
    swaps = sum(1 for a, b in zip(versions, versions[1:]) if a.version != b.version)
    return LoadSummary(
        wall_s=wall_s, requests=len(chats), answered=len(answered),
        throughput_rps=len(answered) / wall_s,
        tokens_per_s=sum(r.completion_tokens for r in answered) / wall_s,
        latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
        latency_max_s=max(latencies, default=None),
        ttft_p50_s=percentile([r.ttft_s for r in answered if r.ttft_s is not None], 50),
        errors=dict(sorted(Counter(r.error for r in records if r.error is not None).items())),
        server_errors=sum(r.server_error for r in records),
        feedback_sent=len(feedback), feedback_ok=sum(r.ok for r in feedback),
        versions_seen=sorted(first_seen), version_first_seen_s=dict(sorted(first_seen.items())),
        answers_across_swap=sum(len(r.policy_versions) > 1 for r in answered),
        swaps_observed=swaps)


def versions_text(versions: list[int]) -> str:
    """``v0..v40 (41)`` for a long list of versions, ``[0, 1]`` for a short one."""
    if len(versions) <= 4:
        return str(versions)
    return f"v{versions[0]}..v{versions[-1]} ({len(versions)})"
