"""``online-sao serve``: wire the model, engine, producer, logger and follower into the app, run uvicorn.

:func:`build_stack` is the wiring (also used by the integration tests and the
benchmark, so they run what production runs); :func:`run_server` adds uvicorn
and the shutdown order (SIGTERM or Ctrl-C): uvicorn stops listening and the app
stops admitting (:class:`DrainingServer`: requests that sampled nothing yet are
answered 503 with Retry-After at once, so their clients retry on another
replica), answers already sampling may finish for :data:`SHUTDOWN_GRACE_S` less
:data:`CUT_MARGIN_S` and are then cut (503, or a stream's error event), the app's
lifespan stops the follower and the engine and flushes the interaction log
(whatever the broker did not acknowledge within ``shutdown_flush_s`` stays in the
spool for the next start), then the producer is closed and, after a SIGTERM, the
process exits 0. :class:`BackgroundServer` runs an app on uvicorn in a thread,
for tests and benchmarks.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from transformers import AutoConfig, GenerationConfig

from online_sao.config import Config, ConfigError
from serving.app import Follower, build_app
from serving.auth import check_exposure
from serving.engine.base import InferenceEngine
from serving.engine.self_check import served_context_length
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from streams.base import DeliveryReport, Producer, StreamBackend
from streams.tail import iter_records_since

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 30
"""uvicorn's graceful shutdown: how long requests may go on after SIGTERM before uvicorn cancels what is
left. The Kubernetes manifest budgets its pod's terminationGracePeriodSeconds (50) for preStop (5 s),
this, and the log's flush (serving.shutdown_flush_s, 10 s) (docs/deploy/k8s/serving.yaml)."""
CUT_MARGIN_S = 2.0
"""The app cuts what still runs this long before uvicorn's grace ends, so that the cut answers (a 503
body, a stream's error event) and the aborted records are written before uvicorn cancels their tasks
(a cancelled task answers a bare 500, or drops its stream without an error event)."""
READBACK_TIMEOUT_S = 30.0
"""Longest wait for the next record while the topics are read back after a restart
(serving.spool_readback); a read back that stalls is tried again, and nothing is sent meanwhile."""


class LazyProducer(Producer):
    """Creates the backend's producer on first use, so serving starts (and spools) while the broker is down."""

    def __init__(self, backend: StreamBackend):
        self._backend = backend
        self._producer: Producer | None = None
        self._lock = threading.Lock()

    def _get(self) -> Producer:
        with self._lock:
            if self._producer is None:
                self._producer = self._backend.producer()  # StreamUnavailable while unreachable
            return self._producer

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        self._get().send(topic, value, key=key, on_delivery=on_delivery)

    def flush(self, timeout_s: float | None = None) -> None:
        if self._producer is not None:
            self._producer.flush(timeout_s)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()

    def abandon(self) -> None:
        if self._producer is not None:
            self._producer.abandon()


@dataclass
class ServingStack:
    app: FastAPI
    engine: InferenceEngine
    logger: InteractionLogger
    producer: Producer
    metrics: ServingMetrics
    tokenizer: object
    follower: Follower | None = None


def stop_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The tokenizer's eos and every eos id of the model's generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is all there is
        eos = None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def make_logger(cfg: Config, producer: Producer, backend: StreamBackend | None = None) -> InteractionLogger:
    """The interaction log; with ``backend`` a restarted spool is read back from its topics first."""

    def readback(topics: list[str], since_s: float):
        return iter_records_since(backend, topics, int(since_s * 1000), timeout_s=READBACK_TIMEOUT_S)

    return InteractionLogger(producer, cfg.kafka.topics, cfg.spool_dir, LogSettings.from_config(cfg.serving),
                             readback=readback if backend is not None else None)


def make_engine(cfg: Config, model_dir: Path, tokenizer) -> InferenceEngine:
    """The configured engine over ``model_dir``; with ``deploy.canary_share`` above 0, two of
    them behind a :class:`~serving.engine.canary.CanaryEngine` (the second answers with the champion),
    which share this process's memory (``serving.vllm_memory_share``)."""
    if cfg.deploy.canary_share > 0:
        from serving.engine.canary import CanaryEngine

        return CanaryEngine(one_engine(cfg, model_dir, tokenizer, engines=2),
                            one_engine(cfg, model_dir, tokenizer, engines=2), cfg.deploy.canary_share)
    return one_engine(cfg, model_dir, tokenizer)


def one_engine(cfg: Config, model_dir: Path, tokenizer, engines: int = 1) -> InferenceEngine:
    """One engine of the configured kind over ``model_dir``, one of ``engines`` in this process (a vLLM
    engine takes its part of ``serving.vllm_memory_share``: :func:`.vllm_settings.memory_args`)."""
    if cfg.serving.engine == "vllm":
        try:
            from serving.engine.vllm_engine import VLLMEngine  # optional extra: imported only when chosen
        except ImportError as exc:
            raise ConfigError(f"serving.engine is 'vllm' but vLLM does not import here ({exc}); install the "
                              "vllm extra (docs/SERVING.md) or use serving.engine: torch") from None

        from serving.engine.vllm_settings import memory_args

        return VLLMEngine(model_dir, cfg.serving, dtype=cfg.model.dtype,
                          **memory_args(cfg.serving.vllm_memory_share, engines))
    from online_sao.modeling import load_policy
    from serving.engine.torch_engine import TorchEngine

    device = engine_device(cfg.serving.device)
    return TorchEngine(load_policy(model_dir, cfg.model.dtype).to(device), tokenizer, cfg.serving)


def engine_device(setting: str) -> torch.device:
    """The torch device ``serving.device`` names on this host (``auto``: the first GPU torch sees, else
    the CPU). ConfigError for a GPU where torch sees none or fewer: the engine would fail on its first
    request, after the server had said it was ready."""
    if setting == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= seen:
            raise ConfigError(f"serving.device is {setting!r} but torch sees {seen} CUDA GPU(s) here; "
                              "use 'auto' or 'cpu', or make the GPU visible (CUDA_VISIBLE_DEVICES)")
    return device


def build_stack(cfg: Config, model_dir: Path, backend: StreamBackend, engine: InferenceEngine | None = None,
                follower_factory=None) -> ServingStack:
    """Everything ``online-sao serve`` runs, over ``backend`` (Kafka in production)."""
    from online_sao.modeling import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    engine = engine if engine is not None else make_engine(cfg, model_dir, tokenizer)
    max_model_len = served_context_length(AutoConfig.from_pretrained(model_dir))
    producer = LazyProducer(backend)
    logger = make_logger(cfg, producer, backend)
    metrics = ServingMetrics(CollectorRegistry())
    follower = follower_factory(engine, metrics) if follower_factory is not None else None
    app = build_app(engine, logger, cfg, tokenizer, metrics, follower,
                    stop_token_ids=stop_token_ids(model_dir, tokenizer), max_model_len=max_model_len)
    return ServingStack(app, engine, logger, producer, metrics, tokenizer, follower)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the app when it begins to shut down: ``on_shutdown(cut_after_s)``
    (:meth:`serving.turn.InFlight.begin_shutdown`, the seconds the app has before it must cut what
    still runs, None without a limit) is called before uvicorn waits for the open requests, which
    ASGI itself has no message for (the lifespan's shutdown comes only after them)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[float | None], None] | None):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        if self._on_shutdown is not None:
            grace = self.config.timeout_graceful_shutdown
            self._on_shutdown(None if grace is None else max(0.0, grace - CUT_MARGIN_S))
        await super().shutdown(sockets)


TRUST_PROXY_HEADERS = False
"""Whether uvicorn takes a caller's address from ``X-Forwarded-For``: it does by default for a loopback
peer, and every caller of a loopback-bound server is one, so a header the client wrote chose its rate
limit bucket (a new address per request: no limit) and turned a loopback caller, not limited, into a
limited one. The rate limit and the loopback rule read the peer's address."""


def draining_server(app: FastAPI, **config) -> DrainingServer:
    """``app`` (one of :func:`serving.app.build_app`, or any other) on a :class:`DrainingServer`."""
    inflight = getattr(app.state, "inflight", None)
    config = {"proxy_headers": TRUST_PROXY_HEADERS, **config}
    return DrainingServer(uvicorn.Config(app, **config), None if inflight is None else inflight.begin_shutdown)


def serve_until_stopped(server: uvicorn.Server) -> None:
    """Run ``server`` (blocking) on this thread; a SIGTERM ends it gracefully and returns, as Ctrl-C
    does apart from the KeyboardInterrupt. uvicorn raises the signal it caught again once it has shut
    down, which with the default handler would kill the process before the caller's cleanup (closing
    the producer) and exit with the signal's status instead of 0."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        server.run()
        return
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(signum: int, frame: object) -> None:
    """The SIGTERM uvicorn raises again after its graceful shutdown: already handled."""


def run_server(cfg: Config, model_dir: Path) -> int:
    """Serve the Hugging Face model in ``model_dir`` until interrupted; returns the exit code. The
    caller holds the spool directory (:func:`serving.spool_lock.exclusive_spool`)."""
    from streams.kafka_backend import KafkaBackend

    check_exposure(cfg.serving)
    backend = KafkaBackend(cfg.kafka)
    stack = build_stack(cfg, model_dir, backend, follower_factory=follower_factory(cfg, backend))
    server = draining_server(stack.app, host=cfg.serving.host, port=cfg.serving.port, log_level="info",
                             timeout_graceful_shutdown=SHUTDOWN_GRACE_S, timeout_keep_alive=cfg.serving.keep_alive_s)
    try:
        serve_until_stopped(server)  # uvicorn raises the Ctrl-C it caught again once it has shut down
    finally:
        if stack.logger.spool_records == 0:
            stack.producer.close()
        else:  # what the producer still holds is also in the spool: stop now, not after its delivery timeout
            stack.producer.abandon()
        log.info("serving stopped")
    return 0


def follower_factory(cfg: Config, backend: StreamBackend):
    """Makes the weights follower of ``online-sao serve``: the weights topic, the weight store,
    swap outcomes and an operator's hold into the metrics, unreadable notices to the dead-letter topic
    (through a producer of its own, made on the first one: serving starts while the broker is down)."""
    from online_sao.weights import open_weight_store
    from serving.weights_follower import WeightsFollower

    def make(engine: InferenceEngine, metrics: ServingMetrics) -> WeightsFollower:
        # the topic may carry other deployments' notices (keyed by model): follow this model's only
        follower = WeightsFollower(backend, cfg.kafka.topics.weights, open_weight_store(cfg.weight_store_url),
                                   engine, on_result=metrics.observe_swap, model_name=cfg.serving.model_name,
                                   dead_letters=(LazyProducer(backend), cfg.kafka.topics.dead_letters))
        metrics.watch_hold(lambda: follower.holds.held_version)
        return follower

    return make


class BackgroundServer:
    """An app on uvicorn in a daemon thread (tests, benchmarks); ``port=0`` picks a free port. It shuts
    down as ``online-sao serve`` does (:class:`DrainingServer`), with ``grace_s`` for open requests."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, keep_alive_s: float = 65.0,
                 grace_s: float = 10.0):
        self._server = draining_server(app, host=host, port=port, log_level="warning",
                                       timeout_graceful_shutdown=grace_s, timeout_keep_alive=keep_alive_s)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self.host = host

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start within {timeout_s} s")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful, as after a SIGTERM: requests not started are refused (503), answers being sampled finish
        (or are cut at the end of ``grace_s``), then the app's lifespan shuts down (flushing the log)."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"uvicorn did not stop within {timeout_s} s")
