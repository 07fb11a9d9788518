"""Segments and answer monitors in serving's /metrics, over real HTTP (uvicorn, FakeEngine)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from serving.app import build_app
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from serving.server import BackgroundServer
from streams.memory import InMemoryBackend
from tests.serving.conftest import FakeHttpServer, Harness, serving_config
from tests.serving.fakes import FakeEngine

REPEATING = "la la la la la la la la"
"""The scripted answer: a phrase repeated, so the repetition gauge is far from 0."""


@pytest.fixture
def make_server(tmp_path, chat_tokenizer) -> Iterator:
    servers: list[BackgroundServer] = []

    def make(**overrides) -> FakeHttpServer:
        cfg = serving_config(tmp_path, **overrides)
        backend = InMemoryBackend(cfg.kafka)
        backend.ensure_topics()
        producer = backend.producer()
        eos = chat_tokenizer.eos_token_id
        engine = FakeEngine(list(chat_tokenizer(REPEATING, add_special_tokens=False)["input_ids"]) + [eos])
        logger = InteractionLogger(producer, cfg.kafka.topics, cfg.spool_dir, LogSettings.from_config(cfg.serving))
        metrics = ServingMetrics(CollectorRegistry())
        server = BackgroundServer(build_app(engine, logger, cfg, chat_tokenizer, metrics, max_model_len=512)).start()
        servers.append(server)
        return FakeHttpServer(server.url, engine, Harness(None, engine, logger, cfg, producer, backend, metrics,
                                                          chat_tokenizer))

    yield make
    for server in servers:
        server.stop()


def chat(server: FakeHttpServer, **fields) -> httpx.Response:
    body = {"model": "online-sao", "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)


def scrape(server: FakeHttpServer) -> dict[str, dict[tuple, float]]:
    """Every sample of /metrics: family name -> {label values: value}."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
            for family in text_string_to_metric_families(text)}


def test_requests_per_segment_are_bounded_to_the_top_n_and_other(make_server):
    server = make_server(**{"deploy.segments_top_n": 2})
    users = ["alice"] * 3 + ["bob"] * 2 + [f"rare-{i}" for i in range(6)] + [None]
    for user in users:
        response = chat(server, **({} if user is None else {"user": user}))
        assert response.status_code == 200, response.text
    per_segment = {dict(k)["segment"]: v for k, v in scrape(server)["sao_serving_segment_requests"].items()}
    assert per_segment == {"alice": 3.0, "bob": 2.0, "other": 7.0}  # six rare users and one without a user
    logged = sorted((r.segment or "-") for r in server.harness.interactions())
    assert logged == sorted((u or "-") for u in users)  # every record carries its own key, not the label


def test_the_segment_can_come_from_a_metadata_field(make_server):
    server = make_server(**{"serving.segment_field": "team"})
    assert chat(server, user="alice", metadata={"team": "red"}).status_code == 200
    assert chat(server, user="alice").status_code == 200  # no team: no segment
    assert [r.segment for r in server.harness.interactions()] == ["red", None]
    per_segment = {dict(k)["segment"]: v for k, v in scrape(server)["sao_serving_segment_requests"].items()}
    assert per_segment == {"red": 1.0, "none": 1.0, "other": 0.0}


def test_a_segment_key_the_record_cannot_hold_is_refused(make_server):
    server = make_server()
    response = chat(server, user="two\nlines")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "user" and "printable" in response.json()["error"]["message"]
    assert server.harness.interactions() == []


def test_length_and_repetition_gauges_follow_the_recent_answers(make_server, chat_tokenizer):
    server = make_server(**{"serving.monitor_window": 3, "deploy.monitor_ngram": 2})
    before = scrape(server)
    assert math.isnan(before["sao_serving_monitor_mean_length"][()])
    assert math.isnan(before["sao_serving_monitor_repetition"][()])
    for _ in range(2):
        assert chat(server).status_code == 200
    answer = server.engine.script  # the tokens every answer samples (the stop token included)
    bigrams = [tuple(answer[i:i + 2]) for i in range(len(answer) - 1)]
    repeated_share = (len(bigrams) - len(set(bigrams))) / len(bigrams)  # a first occurrence is not a repeat
    after = scrape(server)
    assert after["sao_serving_monitor_mean_length"][()] == len(answer)
    assert after["sao_serving_monitor_repetition"][()] == pytest.approx(repeated_share)
    assert repeated_share > 0.5
    server.script("ok")  # shorter answers push the long ones out of the window of 3
    for _ in range(3):
        assert chat(server).status_code == 200
    short = len(server.engine.script)
    assert scrape(server)["sao_serving_monitor_mean_length"][()] == short < len(answer)


def test_a_caller_does_not_choose_its_address_with_x_forwarded_for(make_server):
    """uvicorn's default trusts X-Forwarded-For from a loopback peer, which every caller of a
    loopback-bound server is: a header chose the caller's rate-limit bucket (one per request: no
    limit) and made a loopback caller, not limited, a limited one."""
    server = make_server(**{"serving.rate_limit_per_minute": 1, "serving.rate_limit_burst": 2})
    statuses = [httpx.get(f"{server.url}/v1/models", headers={"X-Forwarded-For": "203.0.113.7"}).status_code
                for _ in range(4)]
    assert statuses == [200] * 4  # the peer, loopback, is not limited
