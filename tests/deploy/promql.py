"""What the project's /metrics put out, and checks that a PromQL expression names only that:
shared by the alert rules' tests and the Grafana dashboard's."""

from __future__ import annotations

import re
import urllib.request

import promql_parser
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from serving.app import _ROUTES
from serving.engine.base import SwapResult
from serving.metrics import ServingMetrics
from serving.monitoring import ServingMonitors
from trainer.exporter import LearnerExporter
from trainer.feed import KeepingUp
from trainer.join_state import JoinCounters
from trainer.rank_zero import COUNTERS

Exported = dict[str, list[dict[str, str]]]
"""Sample name -> the label sets it was exported with."""

SELECTOR = re.compile(r"\b(sao_\w+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def samples(text: str) -> Exported:
    """The samples of a /metrics page."""
    found: Exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(dict(sample.labels))
    return found


def exported_samples() -> Exported:
    """What serving's /metrics and the learner's exporter put out, each with every family filled."""
    metrics = ServingMetrics(CollectorRegistry())
    metrics.watch(queue_depth=lambda: 0.0, spool_bytes=lambda: 0.0, spool_records=lambda: 0.0,
                  policy_version=lambda: 3.0)
    metrics.watch_monitors(ServingMonitors(top_n=2, window=8, ngram=2))
    metrics.watch_hold(lambda: -1.0)
    metrics.requests.labels("/v1/chat/completions", "200").inc()
    metrics.request_latency.labels("/v1/chat/completions").observe(0.5)
    metrics.first_token_latency.labels("/v1/chat/completions").observe(0.1)
    metrics.observe_swap(SwapResult(version=3, applied=True, load_s=0.1, stall_s=0.01))
    found = samples(metrics.render().decode())

    learner = LearnerExporter("127.0.0.1", 0)
    try:
        learner.step(5, 4, 0.5, {"mean_length": 10.0}, {name: 0.0 for name in COUNTERS} | JoinCounters().metrics())
        learner.keeping_up(KeepingUp(3, 1, 2, 0, 1.5, 2.5))
        learner.decision({"repetition": 0.1}, [])
        learner.sources({"judge": (0.7, 12), "user": (0.4, 3)})
        with urllib.request.urlopen(f"http://127.0.0.1:{learner.port}/metrics", timeout=5) as response:
            learner_text = response.read().decode()
    finally:
        learner.close()
    for name, labels in samples(learner_text).items():
        found.setdefault(name, []).extend(labels)
    return found


def check_names(expr: str, exported: Exported, where: str) -> None:
    """``expr`` parses as PromQL, and every ``sao_`` metric, label and exact label value in it (a
    regular expression that only lists values counts as those values) is one the project exports
    (a ``route`` of serving's metrics: one of its paths)."""
    promql_parser.parse(expr)
    selectors = SELECTOR.findall(expr)
    assert selectors or "up{" in expr, f"{where}: none of the project's metrics"
    for name, matchers in selectors:
        assert name in exported, f"{where}: {name} is not exported"
        label_sets = exported[name]
        for label, op, value in MATCHER.findall(matchers):
            assert any(label in labels for labels in label_sets), f"{where}: {name} has no label {label}"
            if op == "=":
                exact = [value]
            elif op == "=~" and re.fullmatch(r"\w+(\|\w+)*", value):
                exact = value.split("|")  # a list of values, each of which must exist
            else:
                continue
            for one in exact:
                if name.startswith("sao_serving_") and label == "route":
                    assert one in _ROUTES, f"{where}: serving counts no route {one}"
                else:
                    assert any(labels.get(label) == one for labels in label_sets), \
                        f"{where}: {name} never has {label}={one!r}"


API_ROUTES = frozenset(route for route in _ROUTES if route.startswith("/v1/"))
"""Serving's routes that users call (the rest are probes and Prometheus's scrape)."""
_ROUTE_MATCH = {"=": lambda value, route: route == value, "!=": lambda value, route: route != value,
                "=~": lambda value, route: re.fullmatch(value, route) is not None,
                "!~": lambda value, route: re.fullmatch(value, route) is None}


def request_routes(expr: str) -> list[set[str]]:
    """For each selector of ``sao_serving_requests_total`` in ``expr``, the routes it counts (of
    serving's paths and ``other``)."""
    counted = []
    for name, matchers in SELECTOR.findall(expr):
        if name != "sao_serving_requests_total":
            continue
        routes = set(_ROUTES) | {"other"}
        for label, op, value in MATCHER.findall(matchers):
            if label == "route":
                routes = {route for route in routes if _ROUTE_MATCH[op](value, route)}
        counted.append(routes)
    return counted
