"""The wiring of ``online-sao serve``: stop tokens, the lazy producer, exposure rules, swap metrics, SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from online_sao.config import load_config
from serving.engine.base import SwapResult
from serving.metrics import ServingMetrics
from serving.server import LazyProducer, run_server, stop_token_ids
from streams.base import StreamUnavailable, TopicPartition
from streams.memory import InMemoryBackend


def test_stop_tokens_are_the_tokenizer_eos_and_every_generation_config_eos(tiny_model_dir):
    from online_sao.modeling import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = stop_token_ids(tiny_model_dir, tokenizer)
    assert ids == {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}


class RecordedVLLMEngine:
    """Stands for serving.engine.vllm_engine.VLLMEngine (no vLLM here): keeps its arguments."""

    def __init__(self, model_dir, cfg, **kwargs):
        self.model_dir, self.cfg, self.kwargs = model_dir, cfg, kwargs


@pytest.mark.parametrize("share, canary, expected", [
    (None, 0.0, {}),
    (0.5, 0.0, {"gpu_memory_utilization": 0.5}),
    (0.5, 0.2, {"gpu_memory_utilization": 0.25}),
])
def test_the_vllm_engines_get_the_configured_memory_share(tmp_path, monkeypatch, share, canary, expected):
    """vLLM's default (0.92 of the host's memory on its CPU build) failed the start on a host where other
    processes held more than 8% of it, and no setting could lower it; a canary's two engines could never fit."""
    from types import ModuleType

    from serving.server import make_engine

    fake = ModuleType("serving.engine.vllm_engine")
    fake.VLLMEngine = RecordedVLLMEngine
    monkeypatch.setitem(sys.modules, "serving.engine.vllm_engine", fake)
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "serving.engine": "vllm",
                                             "serving.vllm_memory_share": share, "deploy.canary_share": canary})
    built = make_engine(cfg, tmp_path, tokenizer=None)
    engines = [built.newest, built.champion] if canary else [built]
    assert [engine.kwargs for engine in engines] == [{"dtype": cfg.model.dtype, **expected}] * len(engines)


def test_the_lazy_producer_waits_for_the_broker_to_exist():
    class Flaky(InMemoryBackend):
        reachable = False

        def producer(self):
            if not self.reachable:
                raise StreamUnavailable("no broker yet")
            return super().producer()

    backend = Flaky()
    backend.create_topic("t", 1)
    producer = LazyProducer(backend)
    producer.flush(1)  # nothing to flush, nothing created
    with pytest.raises(StreamUnavailable):
        producer.send("t", b"v")
    backend.reachable = True
    acks = []
    producer.send("t", b"v", key=b"k", on_delivery=acks.append)
    assert acks == [None] and backend.end_offset(TopicPartition("t", 0)) == 1


def test_serving_beyond_loopback_without_api_keys_is_refused_before_anything_starts(tmp_path):
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "serving.host": "0.0.0.0"})
    with pytest.raises(ValueError, match="api_keys is empty"):
        run_server(cfg, tmp_path / "models" / "base")
    assert not (tmp_path / "models").exists()


def test_swap_outcomes_are_counted():
    metrics = ServingMetrics(CollectorRegistry())
    metrics.observe_swap(SwapResult(3, True, load_s=0.2, stall_s=0.004))
    metrics.observe_swap(SwapResult(2, False, load_s=0.01, stall_s=0.0, reason="older"))
    text = metrics.render().decode()
    assert 'sao_serving_weight_swaps_total{outcome="applied"} 1.0' in text
    assert 'sao_serving_weight_swaps_total{outcome="not_applied"} 1.0' in text
    assert "sao_serving_swap_stall_seconds_count 1.0" in text
    assert "sao_serving_swap_load_seconds_count 2.0" in text


SERVE = """
import logging, sys
from pathlib import Path

import streams.kafka_backend
from online_sao.config import load_config
from serving.server import run_server
from streams.memory import InMemoryBackend


def backend(cfg):  # no broker here: an in-memory one with the topics, as run_server would find them
    memory = InMemoryBackend(cfg)
    memory.ensure_topics()
    return memory


logging.basicConfig(level=logging.INFO)
streams.kafka_backend.KafkaBackend = backend
cfg = load_config(environ={}, overrides={"paths.data_dir": sys.argv[1], "serving.port": int(sys.argv[2])})
sys.exit(run_server(cfg, Path(sys.argv[3])))
"""
"""``online-sao serve``'s run_server in a process of its own, so that the SIGTERM is a real one."""


def test_a_sigterm_stops_serving_gracefully_runs_its_cleanup_and_exits_0(tmp_path, tiny_model_dir, free_port):
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(tmp_path), str(free_port), str(tiny_model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, ready = time.monotonic() + 120, False
        while not ready and time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{free_port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert ready and proc.poll() is None, "serving did not become ready"
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    assert "serving stopped" in output  # run_server's cleanup after uvicorn, which the signal used to skip


class RecordingEngine:
    """What the weights follower needs of an engine: the version it serves, and swaps."""

    policy_version = 0

    def swap_weights(self, version, state, force=False):
        self.policy_version = version
        return SwapResult(version, True, 0.0, 0.0)


def test_the_follower_of_serve_follows_its_own_models_notices_only(tmp_path):
    import torch

    from online_sao.schemas import WeightsNotice, encode
    from online_sao.weights import open_weight_store
    from serving.server import follower_factory
    from tests.fixtures.models import tiny_config

    cfg = tiny_config(tmp_path, **{"serving.model_name": "alpha"})
    backend = InMemoryBackend()
    backend.ensure_topics()
    store = open_weight_store(cfg.weight_store_url)
    refs = {v: store.save(v, {"w": torch.full((2,), float(v))}) for v in (3, 40)}
    producer = backend.producer()
    for model, version in (("beta", 40), ("alpha", 3)):  # another deployment on the same topic
        ref = refs[version]
        producer.send(cfg.kafka.topics.weights, encode(WeightsNotice(version=version, location=ref.location,
                                                                     checksum=ref.checksum, model=model)),
                      key=model.encode())
    engine = RecordingEngine()
    follower = follower_factory(cfg, backend)(engine, ServingMetrics(CollectorRegistry()))
    follower.start()
    try:
        assert follower.wait_for(lambda: follower.consumed >= 2, 30.0)
        assert engine.policy_version == 3
    finally:
        follower.stop()


def test_the_follower_of_serve_dead_letters_an_unreadable_notice(tmp_path):
    """docs/RECORDS.md says an unreadable record goes to the dead-letter topic; the follower of ``serve``
    was built without one, so a notice from a newer writer was only logged and skipped."""
    from online_sao.schemas import DeadLetter, decode
    from serving.server import follower_factory
    from tests.fixtures.models import tiny_config

    cfg = tiny_config(tmp_path)
    backend = InMemoryBackend()
    backend.ensure_topics()
    producer = backend.producer()
    producer.send(cfg.kafka.topics.weights, b'{"schema_version":2,"kind":"weights","version":9}', key=b"online-sao")
    producer.flush()
    follower = follower_factory(cfg, backend)(RecordingEngine(), ServingMetrics(CollectorRegistry()))
    follower.start()
    try:
        assert follower.wait_for(lambda: follower.consumed >= 1, 30.0)
    finally:
        follower.stop()
    consumer = backend.consumer([cfg.kafka.topics.dead_letters], group_id=None, start="earliest")
    letters = [decode(m.value, DeadLetter) for m in consumer.poll(timeout_s=0.2, max_records=10)]
    assert [(letter.source_topic, letter.offset) for letter in letters] == [(cfg.kafka.topics.weights, 0)]
