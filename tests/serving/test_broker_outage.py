"""Stop the broker while requests run, restart it: every interaction reaches the topic exactly once."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from streams.broker import LocalBroker
from streams.kafka_backend import KafkaBackend
from tests.fixtures.kafka import local_broker_config
from tests.fixtures.models import TINY_MODEL_OVERRIDES
from tests.serving.conftest import start_live_server, wait_until

pytestmark = pytest.mark.kafka


class Traffic:
    """Client threads sending chat requests through the official client until stopped."""

    def __init__(self, live, threads: int = 2):
        self.client = live.openai(timeout=60)
        self.ids: list[str] = []
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                reply = self.client.chat.completions.create(
                    model="online-sao", max_tokens=6,
                    messages=[{"role": "user", "content": f"worker {worker} request {n}"}])
                self.ids.append(reply.interaction_id)
            except Exception as exc:  # collected and asserted on: no request may fail
                self.errors.append(exc)
            n += 1
            time.sleep(0.05)

    def start(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_stop_the_broker_while_requests_run_restart_it_every_interaction_exactly_once(
        tmp_path, kafka_lib_dir, tiny_model_dir, one_torch_thread):
    overrides = {**TINY_MODEL_OVERRIDES, "serving.log_stall_s": 2.0, "serving.log_retry_s": 0.5,
                 "serving.rate_limit_per_minute": 100_000, "serving.rate_limit_burst": 1_000}
    cfg = local_broker_config(tmp_path / "broker", **overrides)
    broker = LocalBroker(cfg, lib_dir=kafka_lib_dir, stop_with_parent=True)
    broker.start()
    live = None
    try:
        KafkaBackend(cfg.kafka).ensure_topics()
        live = start_live_server(cfg, tiny_model_dir)
        logger = live.stack.logger
        traffic = Traffic(live).start()
        assert wait_until(lambda: len(traffic.ids) >= 6, timeout_s=60)
        broker.stop()
        before_outage = len(traffic.ids)
        assert wait_until(lambda: logger.spooling and logger.spool_records > 0, timeout_s=60)
        assert wait_until(lambda: len(traffic.ids) >= before_outage + 10, timeout_s=60)  # serving went on
        broker.start()
        assert wait_until(lambda: not logger.spooling, timeout_s=120)
        during_outage = len(traffic.ids) - before_outage
        assert wait_until(lambda: len(traffic.ids) >= before_outage + during_outage + 4, timeout_s=60)
        traffic.stop()
        assert traffic.errors == []
        assert logger.flush(60.0)
        records = live.read(cfg.kafka.topics.interactions, count=len(traffic.ids), timeout_s=60, settle_s=3)
        seen = Counter(r.interaction_id for r in records)
        assert set(seen) == set(traffic.ids)
        assert [i for i, n in seen.items() if n > 1] == []
        assert len(records) == len(traffic.ids) > during_outage > 0
    finally:
        if live is not None:
            live.stop()
        broker.stop()
