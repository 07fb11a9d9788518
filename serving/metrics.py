"""Prometheus metrics of the serving process, in a registry passed in (no global registry)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from serving.engine.base import SwapResult
from serving.monitoring import ServingMonitors
from serving.turn import ROUTE_PATHS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0,
                    300.0, 600.0)
"""Up to 600 s, twice ``serving.request_timeout_s``'s default (300 s): a request's latency is bounded
by its deadline, and one past the top bucket lands in +Inf, where ``histogram_quantile`` reports the
top bucket's bound (60 s, when it was the top, for a request of 200 s)."""
_SWAP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
TIMEOUT_STAGES = ("queued", "running")
"""Where a request was when its deadline passed: no token sampled yet (queued for a batch slot, or being
prefilled), or its answer begun (sampling, or its record awaiting durability)."""


class ServingMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter("sao_serving_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("sao_serving_prompt_tokens", "Prompt tokens processed", registry=registry)
        self.completion_tokens = Counter("sao_serving_completion_tokens", "Tokens sampled", registry=registry)
        self.request_latency = Histogram("sao_serving_request_latency_seconds",
                                         "Time from request arrival to the last token, by route",
                                         ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.first_token_latency = Histogram("sao_serving_time_to_first_token_seconds",
                                             "Time from request arrival to the first sampled token",
                                             ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.policy_version = Gauge("sao_serving_policy_version", "Policy version being served",
                                    registry=registry)
        self.swaps = Counter("sao_serving_weight_swaps", "Weight versions considered, by outcome",
                             ["outcome"], registry=registry)
        self.swap_load_seconds = Histogram("sao_serving_swap_load_seconds",
                                           "Time to load and verify a version off the request path",
                                           buckets=_SWAP_BUCKETS, registry=registry)
        self.swap_stall_seconds = Histogram("sao_serving_swap_stall_seconds",
                                            "Time decoding was paused for a switch",
                                            buckets=_SWAP_BUCKETS, registry=registry)
        self.log_queue_depth = Gauge("sao_serving_log_queue_depth",
                                     "Records waiting for the interaction-log sender", registry=registry)
        self.spool_bytes = Gauge("sao_serving_spool_bytes",
                                 "Bytes of records spooled on disk and not yet acknowledged by the broker",
                                 registry=registry)
        self.spool_records = Gauge("sao_serving_spool_records",
                                   "Records spooled on disk and not yet acknowledged by the broker",
                                   registry=registry)
        self.engine_waiting = Gauge("sao_serving_engine_waiting",
                                    "Generation requests queued for a batch slot; new ones are refused once "
                                    "serving.max_waiting wait", registry=registry)
        self.engine_running = Gauge("sao_serving_engine_running",
                                    "Generation requests holding a batch slot (being prefilled or sampling)",
                                    registry=registry)
        self.request_timeouts = Counter("sao_serving_request_timeouts",
                                        "Generation requests cut at serving.request_timeout_s (504, or a "
                                        "stream's error event), by route and stage", ["route", "stage"],
                                        registry=registry)
        for route in ROUTE_PATHS.values():  # every series from 0, so that rates and alerts see the first one
            for stage in TIMEOUT_STAGES:
                self.request_timeouts.labels(route, stage)

    def observe_timeout(self, route: str, started: bool) -> None:
        """Count a request cut at its deadline on ``route`` (its path), after its first token or before."""
        self.request_timeouts.labels(route, TIMEOUT_STAGES[started]).inc()

    def observe_swap(self, result: SwapResult) -> None:
        """Record one swap attempt of the weights follower (applied, ignored as old, or refused)."""
        self.swaps.labels("applied" if result.applied else "not_applied").inc()
        self.swap_load_seconds.observe(result.load_s)
        if result.applied:
            self.swap_stall_seconds.observe(result.stall_s)

    def watch(self, queue_depth: Callable[[], float], spool_bytes: Callable[[], float],
              spool_records: Callable[[], float], policy_version: Callable[[], float]) -> None:
        """Read these gauges from their owners at scrape time."""
        self.log_queue_depth.set_function(queue_depth)
        self.spool_bytes.set_function(spool_bytes)
        self.spool_records.set_function(spool_records)
        self.policy_version.set_function(policy_version)

    def watch_engine(self, waiting: Callable[[], float], running: Callable[[], float]) -> None:
        """Read the engine's load at scrape time (counted by serving: :class:`serving.turn.InFlight`)."""
        self.engine_waiting.set_function(waiting)
        self.engine_running.set_function(running)

    def watch_canary(self, champion_version: Callable[[], float], routed: Callable[[], float]) -> None:
        """Expose the canary at scrape time: the champion it answers with (-1 before the first)
        and the requests routed to it."""
        Gauge("sao_serving_canary_champion_version", "Champion version answering the canary share "
              "(deploy.canary_share; -1 before the first champion notice)",
              registry=self.registry).set_function(champion_version)
        Gauge("sao_serving_canary_requests", "Requests answered by the canary's champion so far",
              registry=self.registry).set_function(routed)

    def watch_hold(self, held_version: Callable[[], float]) -> None:
        """Expose an operator's hold at scrape time (``online-sao weights hold``; -1: none)."""
        Gauge("sao_serving_weights_held_version", "Version an operator's hold pins this replica to "
              "(online-sao weights hold; -1: none, the learner's versions are followed)",
              registry=self.registry).set_function(held_version)

    def watch_monitors(self, monitors: ServingMonitors) -> None:
        """Expose ``monitors`` at scrape time: requests per segment label and the answer monitors."""
        self.registry.register(SegmentRequests(monitors))
        Gauge("sao_serving_monitor_mean_length", "Mean sampled tokens per answer over the newest "
              "serving.monitor_window answers (NaN before the first)",
              registry=self.registry).set_function(monitors.mean_length)
        Gauge("sao_serving_monitor_repetition", "Share of repeated deploy.monitor_ngram-grams in the newest "
              "serving.monitor_window answers (NaN without any)",
              registry=self.registry).set_function(monitors.repetition)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SegmentRequests(Collector):
    """``sao_serving_segment_requests{segment}``: interactions logged since start per segment label,
    the top ``deploy.segments_top_n`` by traffic and ``other`` (a gauge: a segment that enters the
    top N takes its count out of ``other``)."""

    def __init__(self, monitors: ServingMonitors) -> None:
        self.monitors = monitors

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("sao_serving_segment_requests",
                                   "Interactions logged since start, by segment (top N by traffic, then other)",
                                   labels=["segment"])
        for label, count in self.monitors.segment_requests().items():
            family.add_metric([label], float(count))
        yield family
