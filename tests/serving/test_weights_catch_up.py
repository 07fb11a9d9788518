"""Readiness after a start waits for the weights follower to catch up with the weights topic.

A restarted replica used to report ready (and answer) with the weights of ``model.path``, version
0, until its follower had read the topic and loaded the newest version: for a moment with the
broker up, for the whole outage with it down. ``/readyz`` now answers 503 ``catching_up_weights``
until the follower's first pass is applied, ``serving.weights_catch_up_s`` at most; ``/healthz``
stays 200.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from online_sao.modeling import load_policy
from online_sao.weights import InProcessWeightStore
from serving import weights_follower
from serving.app import build_app
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from serving.weights_follower import WeightsFollower
from streams.base import StreamUnavailable
from streams.memory import InMemoryBackend
from tests.serving.conftest import serving_config
from tests.serving.fakes import FakeEngine
from tests.serving.test_weights_follower import TOPIC, WAIT_S, Canary, FlakyStore, notice, send, state_for

POLL_S = 0.02
"""The follower's poll timeout in these tests: a fresh topic is read at once."""

UNREACHABLE_CATCH_UP_S = 3.0
"""``serving.weights_catch_up_s`` with the broker unreachable: long enough that the test sees the
replica unready (the follower's first failed connect included) on a loaded box."""
UNREACHABLE_SEEN_S = 2.0
"""Until ``/readyz`` says the topic is unreachable (the follower's first connect failed: at once
unloaded); within :data:`UNREACHABLE_CATCH_UP_S`, so that the replica is still unready then."""
CLOCK_STARTED_BEFORE_S = 1.0
"""The app's catch-up clock starts inside ``start_app``, before the test's own clock."""


def tiny_state(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), float(version))}


class GatedStore:
    """An in-process store whose load of ``gated`` waits for ``gate`` (a slow read of the newest version)."""

    def __init__(self) -> None:
        self.store = InProcessWeightStore()
        self.gate = threading.Event()
        self.loading = threading.Event()
        """Set once the gated load began."""
        self.gated: str | None = None

    def save(self, version: int, state):
        return self.store.save(version, state)

    def load(self, location: str, checksum: str):
        if location == self.gated:
            self.loading.set()
            assert self.gate.wait(WAIT_S), "the test did not open the gate"
        return self.store.load(location, checksum)


class UnreachableBackend(InMemoryBackend):
    """A backend whose broker cannot be reached: every consumer it is asked for fails."""

    def consumer(self, *args, **kwargs):
        raise StreamUnavailable("no broker (test)")


@pytest.fixture
def quick_retries(monkeypatch):
    """Reconnects and champion retries within a tenth of a second."""
    monkeypatch.setattr(weights_follower, "RETRY_S", 0.05)
    monkeypatch.setattr(weights_follower, "CHAMPION_RETRY_S", 0.02)
    monkeypatch.setattr(weights_follower, "CHAMPION_RETRY_MAX_S", 0.1)


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    """The tiny model, for the canary's real engines."""
    return load_policy(tiny_model_dir).eval()


@pytest.fixture
def start_app(tmp_path, chat_tokenizer):
    """``start(backend, store, model_name=None, **config overrides)``: the app over a FakeEngine with a real
    weights follower (of ``model_name``'s notices; None: every notice) on ``backend``'s weights topic,
    started (its lifespan runs) under a TestClient."""
    opened: list[TestClient] = []

    def start(backend: InMemoryBackend, store, model_name: str | None = None,
              **overrides) -> tuple[TestClient, FakeEngine]:
        cfg = serving_config(tmp_path, **overrides)
        engine = FakeEngine([chat_tokenizer.eos_token_id])
        producer = InMemoryBackend(cfg.kafka)
        producer.ensure_topics()
        logger = InteractionLogger(producer.producer(), cfg.kafka.topics, cfg.spool_dir,
                                   LogSettings.from_config(cfg.serving))
        follower = WeightsFollower(backend, TOPIC, store, engine, model_name=model_name, poll_timeout_s=POLL_S)
        app = build_app(engine, logger, cfg, chat_tokenizer, ServingMetrics(CollectorRegistry()), follower,
                        max_model_len=512)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        return client, engine

    yield start
    for client in opened:
        client.__exit__(None, None, None)


def ready_within(client: TestClient, timeout_s: float) -> dict | None:
    """``/readyz``'s body once it answers 200 (None: not within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = client.get("/readyz")
        if answer.status_code == 200:
            return answer.json()
        time.sleep(0.02)
    return None


def until_catching_up_says(client: TestClient, wanted: str, timeout_s: float) -> str:
    """``/readyz``'s catching-up reason once it says ``wanted`` (503 all along); the last one after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    reason = assert_catching_up(client)
    while wanted not in reason and time.monotonic() < deadline:
        time.sleep(POLL_S)
        reason = assert_catching_up(client)
    return reason


def assert_catching_up(client: TestClient) -> str:
    """``/readyz`` is 503 ``catching_up_weights`` and ``/healthz`` 200; returns the reason."""
    ready = client.get("/readyz")
    assert ready.status_code == 503, ready.json()
    reason = ready.json()["reason"]
    assert reason.startswith("catching_up_weights: serving v0"), reason
    assert client.get("/healthz").status_code == 200  # liveness: an orchestrator must not kill it meanwhile
    return reason


def test_a_restarted_replica_is_ready_only_once_the_newest_published_version_is_loaded(start_app):
    backend = InMemoryBackend()
    backend.ensure_topics()
    store = GatedStore()
    refs = {v: store.save(v, tiny_state(v)) for v in (1, 2, 3)}
    store.gated = refs[3].location  # the newest version's read is slow
    send(backend, notice(refs[1]), notice(refs[2]), notice(refs[3]))
    client, engine = start_app(backend, store)
    try:
        assert store.loading.wait(WAIT_S)
        reason = assert_catching_up(client)  # before the fix: 200 here, answering with version 0
        assert "loaded the version in force" in reason
        assert client.get("/v1/models").json()["data"][0]["policy_version"] == 0
    finally:
        store.gate.set()
    body = ready_within(client, WAIT_S)
    assert body is not None and body["policy_version"] == 3 and engine.policy_version == 3


def test_a_fresh_weights_topic_is_ready_after_its_first_read(start_app):
    backend = InMemoryBackend()
    backend.ensure_topics()
    client, _ = start_app(backend, InProcessWeightStore())
    started = time.monotonic()
    body = ready_within(client, 5.0)
    assert body is not None and body["policy_version"] == 0
    assert time.monotonic() - started < 2.0


def test_a_ready_replica_says_which_other_models_notices_it_ignored(start_app):
    """A replica whose serving.model_name is not the learner's is ready on v0 for good; its /readyz said
    ready and nothing else, the reason only in its start-up log."""
    backend = InMemoryBackend()
    backend.ensure_topics()
    store = InProcessWeightStore()
    ref = store.save(1, tiny_state(1))
    send(backend, notice(ref).model_copy(update={"model": "old-name"}))
    client, _ = start_app(backend, store, model_name="new-name")
    body = ready_within(client, 5.0)
    assert body is not None and body["policy_version"] == 0
    assert "old-name" in body["weights_note"] and "serving.model_name" in body["weights_note"]

    plain = InMemoryBackend()
    plain.ensure_topics()
    client, _ = start_app(plain, InProcessWeightStore())
    assert "weights_note" not in ready_within(client, 5.0)  # nothing to say: not said

    shared = InMemoryBackend()  # a topic carrying two models' notices, the replica following its own
    shared.ensure_topics()
    store = InProcessWeightStore()
    send(shared, notice(store.save(1, tiny_state(1))).model_copy(update={"model": "new-name"}),
         notice(store.save(2, tiny_state(2))).model_copy(update={"model": "other"}))
    client, _ = start_app(shared, store, model_name="new-name")
    body = ready_within(client, 5.0)
    assert body["policy_version"] == 1 and "weights_note" not in body


def test_an_unreachable_broker_keeps_the_replica_unready_for_weights_catch_up_s_then_it_serves_what_it_has(
        start_app, quick_retries, caplog):
    caplog.set_level(logging.WARNING, logger="serving.app")
    client, _ = start_app(UnreachableBackend(), InProcessWeightStore(),
                          **{"serving.weights_catch_up_s": UNREACHABLE_CATCH_UP_S})
    started = time.monotonic()
    reason = until_catching_up_says(client, "the weights topic is unreachable", UNREACHABLE_SEEN_S)
    assert "the weights topic is unreachable" in reason, reason
    body = ready_within(client, WAIT_S)
    assert body is not None and body["policy_version"] == 0
    assert time.monotonic() - started >= UNREACHABLE_CATCH_UP_S - CLOCK_STARTED_BEFORE_S
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "serving.app"]
    assert any("ready on v0 without the newest published weights" in m and "serving.weights_catch_up_s" in m
               and "unreachable" in m for m in warning), warning


def test_weights_catch_up_s_none_waits_for_ever_and_0_not_at_all(start_app, quick_retries):
    waiting, _ = start_app(UnreachableBackend(), InProcessWeightStore(), **{"serving.weights_catch_up_s": None})
    not_waiting, _ = start_app(UnreachableBackend(), InProcessWeightStore(), **{"serving.weights_catch_up_s": 0})
    assert not_waiting.get("/readyz").status_code == 200
    time.sleep(1.0)
    assert_catching_up(waiting)


def test_a_champion_whose_load_failed_does_not_hold_the_catch_up_and_loads_later(tiny_policy, quick_retries):
    """A champion whose file is gone (or whose store errs) would otherwise keep every start of a canary
    replica unready for the whole of serving.weights_catch_up_s: the newest version answers meanwhile."""
    backend = InMemoryBackend()
    backend.ensure_topics()
    store = FlakyStore(InProcessWeightStore())
    refs = {v: store.store.save(v, state_for(tiny_policy, v)) for v in (1, 2)}
    store.failing[refs[1].location] = 10**9  # the champion's store errs (a transient error, for now)
    send(backend, notice(refs[1], "champion"), notice(refs[2]))
    c = Canary(backend, store, tiny_policy, poll_timeout_s=POLL_S)
    try:
        assert c.follower.wait_for(lambda: c.follower.consumed >= 2 and c.engine.policy_version == 2, WAIT_S)
        assert c.follower.wait_for(lambda: c.follower.caught_up, WAIT_S)
        assert "champion v1 not loaded" in c.follower.catch_up_state and c.engine.champion_version is None
        store.failing[refs[1].location] = 0
        assert c.follower.wait_for(lambda: c.engine.champion_version == 1, WAIT_S)
    finally:
        c.follower.stop()


def test_notices_published_after_the_start_do_not_hold_the_catch_up():
    backend = InMemoryBackend()
    backend.ensure_topics()
    store = InProcessWeightStore()
    refs = {v: store.save(v, tiny_state(v)) for v in (1, 2)}
    send(backend, notice(refs[1]))
    engine = FakeEngine([0])
    follower = WeightsFollower(backend, TOPIC, store, engine, poll_timeout_s=POLL_S)
    follower.start()
    try:
        assert follower.wait_for(lambda: follower.caught_up, WAIT_S) and engine.policy_version == 1
        send(backend, notice(refs[2]))
        assert follower.wait_for(lambda: engine.policy_version == 2, WAIT_S) and follower.caught_up
    finally:
        follower.stop()
