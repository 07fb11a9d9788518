"""Serving's /metrics off the event loop, over real HTTP (uvicorn, FakeEngine): a scrape that waits
(for the spool's lock, held across a write's fsync; for the answer monitors over long answers) leaves
every other request answered meanwhile. And its latency histograms reach the request deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import serving.monitoring
from online_sao.config import load_config
from serving.app import build_app
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from serving.server import BackgroundServer
from serving.spool import Spool
from streams.memory import InMemoryBackend
from tests.serving.conftest import serving_config
from tests.serving.fakes import FakeEngine

LOOP_ANSWERS_S = 3.0
"""A request on a free event loop answers in milliseconds; one behind a frozen loop waits as long
as the scrape does (here until the test lets it go)."""
HELD_AT_MOST_S = 30.0
"""How long the test holds the scrape at most: it lets it go once it has asked the event loop."""


@pytest.fixture
def server(tmp_path, chat_tokenizer) -> Iterator[tuple[str, InteractionLogger]]:
    """The app on uvicorn: its URL and its interaction logger."""
    cfg = serving_config(tmp_path)
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    logger = InteractionLogger(backend.producer(), cfg.kafka.topics, cfg.spool_dir,
                               LogSettings.from_config(cfg.serving))
    engine = FakeEngine(list(chat_tokenizer("ok", add_special_tokens=False)["input_ids"]) + [chat_tokenizer.eos_token_id])
    app = build_app(engine, logger, cfg, chat_tokenizer, ServingMetrics(CollectorRegistry()), max_model_len=512)
    running = BackgroundServer(app).start()
    try:
        yield running.url, logger
    finally:
        running.stop()


def _scrape_in_background(url: str) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    answered: dict[str, httpx.Response] = {}

    def scrape() -> None:
        answered["metrics"] = httpx.get(f"{url}/metrics", timeout=HELD_AT_MOST_S * 2)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    return thread, answered


def _event_loop_answers(url: str, what: str) -> None:
    """/healthz (and ``what`` first, when a chat request) answers while the scrape waits."""
    try:
        if what == "chat":
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=LOOP_ANSWERS_S,
                              json={"model": "online-sao", "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200, chat.text
        health = httpx.get(f"{url}/healthz", timeout=LOOP_ANSWERS_S)
    except httpx.TimeoutException:
        pytest.fail(f"the event loop did not answer within {LOOP_ANSWERS_S:g} s while /metrics waited: "
                    "the scrape runs on the event loop, or holds a lock the loop needs")
    assert health.status_code == 200


def test_a_scrape_waiting_for_the_spool_lock_leaves_the_event_loop_answering(server, monkeypatch):
    url, logger = server
    spool = logger._state.spool
    reached = threading.Event()
    pending_bytes = Spool.pending_bytes

    def watched(self: Spool) -> int:  # the scrape's gauge, about to wait for the lock
        reached.set()
        return pending_bytes.fget(self)

    monkeypatch.setattr(Spool, "pending_bytes", property(watched))
    with spool._lock:  # as Spool.append holds it across a write and its fsync
        scrape, answered = _scrape_in_background(url)
        assert reached.wait(HELD_AT_MOST_S), "the scrape never read the spool's gauges"
        _event_loop_answers(url, "healthz")
        assert scrape.is_alive() and not answered  # still waiting for the spool
    scrape.join(HELD_AT_MOST_S)
    assert answered["metrics"].status_code == 200
    assert "sao_serving_spool_bytes" in answered["metrics"].text


def test_a_slow_answer_monitor_leaves_the_event_loop_answering_and_logging(server, monkeypatch):
    """The repetition monitor over long answers takes a while: meanwhile a chat request is answered
    and its answer logged into the monitors' window (not waiting for the scrape's computation)."""
    url, _ = server
    computing, done = threading.Event(), threading.Event()
    share = serving.monitoring.repeated_ngram_share

    def slow_share(answers: list[list[int]], ngram: int) -> float:
        computing.set()
        done.wait(HELD_AT_MOST_S)
        return share(answers, ngram)

    monkeypatch.setattr(serving.monitoring, "repeated_ngram_share", slow_share)
    scrape, answered = _scrape_in_background(url)
    try:
        assert computing.wait(HELD_AT_MOST_S), "the scrape never computed the repetition monitor"
        _event_loop_answers(url, "chat")
        assert scrape.is_alive() and not answered  # still computing
    finally:
        done.set()
    scrape.join(HELD_AT_MOST_S)
    assert answered["metrics"].status_code == 200


def test_the_latency_buckets_reach_past_the_default_request_deadline():
    """A request may take up to serving.request_timeout_s: with 60 s the top bucket, one of 200 s fell
    in +Inf and histogram_quantile reported 60 s."""
    deadline_s = load_config(environ={}, overrides={}).serving.request_timeout_s
    metrics = ServingMetrics(CollectorRegistry())
    for histogram in (metrics.request_latency, metrics.first_token_latency):
        histogram.labels("/v1/chat/completions").observe(deadline_s * 2 / 3)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for name in ("sao_serving_request_latency_seconds", "sao_serving_time_to_first_token_seconds"):
        bounds = {float(s.labels["le"]): s.value for s in families[name].samples if s.name.endswith("_bucket")}
        finite = sorted(bound for bound in bounds if bound != float("inf"))
        assert finite[-1] >= deadline_s, f"{name}: top bucket {finite[-1]:g} s, below the {deadline_s:g} s deadline"
        below_deadline = [bound for bound in finite if deadline_s * 2 / 3 <= bound <= deadline_s]
        assert below_deadline and bounds[below_deadline[0]] == 1.0  # counted in a finite bucket
