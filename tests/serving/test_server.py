"""The wiring of ``online-sao serve``: stop tokens, the lazy producer, exposure rules, swap metrics."""

from __future__ import annotations

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
