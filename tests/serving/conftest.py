"""Fixtures of the serving tests.

Unit level: ``chat_tokenizer`` (the default model's tokenizer and chat template,
trained on a slice of the corpus in a second) and ``make_harness`` (the real app
over a :class:`FakeEngine` and an InMemoryBackend or a FakeProducer, driven with
Starlette's TestClient). Over real HTTP: ``fake_http_server``, and ``serve``
(uvicorn over a FakeEngine with batch slots whose answers hold: overload,
disconnects, deadlines, shutdown). Integration level: ``live_server`` runs the real app on
uvicorn on a free port in a background thread, with the real TorchEngine on the
tiny model and the real broker.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from apps.default_model.builder import chat_text, train_tokenizer
from online_sao.config import Config, load_config
from online_sao.modeling import load_policy
from apps.default_model.corpus import generate_corpus
from online_sao.schemas import Interaction, Reward, decode
from serving.app import build_app
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from streams.base import Producer
from streams.memory import InMemoryBackend
from tests.serving.fakes import FakeEngine, FakeProducer
from tests.fixtures.processes import wait_until

if TYPE_CHECKING:
    import openai

    from serving.server import BackgroundServer, ServingStack
    from serving.turn import InFlight

ANSWER = "Hello, wörld! 🙂 ok"
"""The fake engine's answer: multi-byte characters exercise incremental decoding."""


@pytest.fixture(scope="session")
def chat_tokenizer():
    texts = [chat_text(e.prompt, e.answer) for e in generate_corpus(seed=0)[:300]]
    return train_tokenizer(texts, vocab_size=400, max_length=512)


def serving_config(tmp_path: Path, **overrides) -> Config:
    return load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), **overrides})


@dataclass
class Harness:
    client: TestClient
    engine: FakeEngine
    logger: InteractionLogger
    cfg: Config
    producer: Producer
    backend: InMemoryBackend | None
    metrics: ServingMetrics
    tokenizer: object

    def records(self, topic: str) -> list[Interaction | Reward]:
        """Every record on ``topic`` once the logger delivered what was submitted."""
        assert self.logger.flush(10.0), "the logger did not deliver within 10 s"
        consumer = self.backend.consumer([topic])
        try:
            return [decode(m.value) for m in consumer.poll(timeout_s=0.1, max_records=10_000)]
        finally:
            consumer.close()

    def interactions(self) -> list[Interaction]:
        """In the order the requests arrived (the topic orders them only per partition)."""
        return sorted(self.records(self.cfg.kafka.topics.interactions), key=lambda r: r.created_at)

    def rewards(self) -> list[Reward]:
        return self.records(self.cfg.kafka.topics.rewards)


@pytest.fixture
def make_harness(tmp_path, chat_tokenizer) -> Iterator:
    """Build the app over fakes; ``producer`` defaults to an InMemoryBackend's."""
    opened: list[TestClient] = []

    def make(script_text: str = ANSWER, producer: Producer | None = None, delay_s: float = 0.0,
             spool_max_bytes: int | None = None, **overrides) -> Harness:
        cfg = serving_config(tmp_path, **overrides)
        backend = None
        if producer is None:
            backend = InMemoryBackend(cfg.kafka)
            backend.ensure_topics()
            producer = backend.producer()
        stop = chat_tokenizer.eos_token_id
        script = list(chat_tokenizer(script_text, add_special_tokens=False)["input_ids"]) + [stop]
        engine = FakeEngine(script, delay_s=delay_s)
        settings = LogSettings.from_config(cfg.serving)
        if spool_max_bytes is not None:  # below the configuration's floor: a spool of a few records
            settings = replace(settings, spool_max_bytes=spool_max_bytes)
        logger = InteractionLogger(producer, cfg.kafka.topics, cfg.spool_dir, settings)
        metrics = ServingMetrics(CollectorRegistry())
        app = build_app(engine, logger, cfg, chat_tokenizer, metrics, max_model_len=512)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        return Harness(client, engine, logger, cfg, producer, backend, metrics, chat_tokenizer)

    yield make
    for client in opened:
        client.__exit__(None, None, None)


@dataclass
class FakeHttpServer:
    """The real app over a :class:`FakeEngine` and an InMemoryBackend, on uvicorn (real HTTP)."""

    url: str
    engine: FakeEngine
    harness: Harness
    """For ``records``/``interactions``; its ``client`` is None (the app is not under a TestClient)."""

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="not-needed-on-loopback", max_retries=0)

    def script(self, text: str) -> None:
        """The fake engine's next answers: ``text`` then the stop token."""
        tokenizer = self.harness.tokenizer
        self.engine.script = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


@contextmanager
def running_fake_http_server(tmp_path: Path, tokenizer) -> Iterator[FakeHttpServer]:
    """The real app on uvicorn over a FakeEngine, with ``tokenizer``; stopped on leaving."""
    from serving.server import BackgroundServer

    cfg = serving_config(tmp_path)
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    engine = FakeEngine([tokenizer.eos_token_id])
    logger = InteractionLogger(producer, cfg.kafka.topics, cfg.spool_dir, LogSettings.from_config(cfg.serving))
    metrics = ServingMetrics(CollectorRegistry())
    server = BackgroundServer(build_app(engine, logger, cfg, tokenizer, metrics, max_model_len=512)).start()
    try:
        yield FakeHttpServer(server.url, engine, Harness(None, engine, logger, cfg, producer, backend, metrics,
                                                         tokenizer))
    finally:
        server.stop()


@pytest.fixture
def fake_http_server(tmp_path, chat_tokenizer) -> Iterator[FakeHttpServer]:
    with running_fake_http_server(tmp_path, chat_tokenizer) as served:
        yield served


MODEL = "online-sao"
MESSAGES = [{"role": "user", "content": "Tell me about tea."}]
HELD_AFTER = 2
"""Tokens each answer samples before the fake engine holds it (until released, cancelled or cut)."""


@dataclass
class Served:
    """The app ``serve`` started; ``inflight`` is its admission state."""

    server: "BackgroundServer"
    engine: FakeEngine
    inflight: "InFlight"
    backend: InMemoryBackend
    topic: str

    @property
    def url(self) -> str:
        return self.server.url

    def openai(self) -> "openai.OpenAI":
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="not-needed-on-loopback", max_retries=0, timeout=60)

    def interactions(self) -> list[Interaction]:
        """What reached the topic (the logger delivers at once in memory mode, and flushes on shutdown)."""
        consumer = self.backend.consumer([self.topic])
        try:
            return [decode(m.value) for m in consumer.poll(timeout_s=0.1, max_records=10_000)]
        finally:
            consumer.close()


def start_served(tmp_path, tokenizer, engine: FakeEngine, grace_s: float, max_model_len: int | None,
                 **overrides) -> Served:
    """The real app on uvicorn over ``engine``, logging into memory (``overrides``: config keys)."""
    from serving.server import BackgroundServer

    cfg = serving_config(tmp_path, **{"serving.log_durability": "memory", **overrides})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    logger = InteractionLogger(backend.producer(), cfg.kafka.topics, cfg.spool_dir,
                               LogSettings.from_config(cfg.serving))
    app = build_app(engine, logger, cfg, tokenizer, ServingMetrics(CollectorRegistry()), max_model_len=max_model_len)
    return Served(BackgroundServer(app, grace_s=grace_s).start(), engine, app.state.inflight, backend,
                  cfg.kafka.topics.interactions)


@pytest.fixture
def serve(tmp_path, chat_tokenizer) -> Iterator:
    """The real app on uvicorn over a FakeEngine whose answers hold after :data:`HELD_AFTER` tokens."""
    started: list[Served] = []

    def make(slots: int, grace_s: float = 10.0, **overrides) -> Served:
        engine = FakeEngine(list(chat_tokenizer(ANSWER, add_special_tokens=False)["input_ids"])
                            + [chat_tokenizer.eos_token_id])
        engine.slots, engine.hold_after = slots, HELD_AFTER
        started.append(start_served(tmp_path, chat_tokenizer, engine, grace_s, 512, **overrides))
        return started[-1]

    yield make
    for served in started:
        served.engine.release.set()
        served.server.stop()  # returns at once for one the test stopped


def raw_post(url: str, body: dict) -> socket.socket:
    """A request on a connection of its own, which the test closes to disconnect (no client library
    holds it open or retries)."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def chat(stream: bool = False, **fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "stream": stream, **fields}


def metric(url: str, name: str) -> str:
    return [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name)][0]


__all__ = ["ANSWER", "FakeProducer", "HELD_AFTER", "Harness", "MESSAGES", "MODEL", "Served", "chat", "metric",
           "raw_post", "wait_until", "serving_config"]


# ----------------------------------------------------------------------------- integration


@dataclass
class LiveServer:
    """The production wiring (:func:`serving.server.build_stack`) on uvicorn, over a real broker."""

    server: "BackgroundServer"
    stack: "ServingStack"
    cfg: Config
    model_dir: Path

    @property
    def base_url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        """As ``online-sao serve`` ends: uvicorn drains and the app flushes its log, then the producer
        is closed (its network thread would otherwise outlive the test)."""
        self.server.stop()
        self.stack.producer.close()

    def openai(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.server.url}/v1", api_key="not-needed-on-loopback", max_retries=0, **kwargs)

    def read(self, topic: str, count: int, timeout_s: float = 30.0, settle_s: float = 1.0) -> list:
        """Every record on ``topic``: waits for ``count``, then ``settle_s`` more for any extra."""
        from streams.kafka_backend import KafkaBackend
        from tests.fixtures.kafka import drain

        consumer = KafkaBackend(self.cfg.kafka).consumer([topic])
        try:
            messages = drain(consumer, count, timeout_s)
            messages += drain(consumer, 10**9, settle_s)
        finally:
            consumer.close()
        return [decode(m.value) for m in messages]


def start_live_server(cfg: Config, model_dir: Path) -> LiveServer:
    from serving.server import BackgroundServer, build_stack, follower_factory
    from streams.kafka_backend import KafkaBackend

    backend = KafkaBackend(cfg.kafka)
    stack = build_stack(cfg, model_dir, backend, follower_factory=follower_factory(cfg, backend))
    return LiveServer(BackgroundServer(stack.app).start(), stack, cfg, model_dir)


@pytest.fixture
def one_torch_thread():
    # OpenMP workers spinning on a shared two-core machine slow tiny models down a lot.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def live_server(tmp_path, tiny_model_dir, kafka_config, one_torch_thread) -> Iterator[LiveServer]:
    from tests.fixtures.models import tiny_config

    cfg = tiny_config(tmp_path).model_copy(update={"kafka": kafka_config})
    live = start_live_server(cfg, tiny_model_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def contract_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2 with the test tokenizer for the engine contract tests (tests/serving/test_engine_contract.py)
    and the vLLM self-check's: its LM head sharpened, so top_p really cuts."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("contract-model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # sharper than a fresh init, so top_p really cuts
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The tiny test model for the engine tests, in eval mode (one load per module)."""
    return load_policy(tiny_model_dir).eval()


@pytest.fixture(params=["padded", "flat"])
def kv_layout(request) -> str:
    """Every engine test runs with both cache layouts (serving/engine/kv_batch.py, flat_kv.py)."""
    return request.param
