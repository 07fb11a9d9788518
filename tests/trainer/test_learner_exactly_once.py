"""SIGKILL mid-stream, restart, and every produced interaction is trained on exactly once.

The learner runs as its own process (``python -m apps.cli learn``) on the
real broker while a producer thread keeps logging rewarded interactions, so the
kill lands while records are still arriving. The restarted learner resumes from
its last checkpoint and drains the topics; SIGTERM then stops it gracefully
(exit 0). The ledger it keeps in the checkpoint directory must hold each
produced id exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from online_sao.modeling import load_policy
from streams.kafka_backend import KafkaBackend
from tests.trainer.traffic import produce, sample_traffic
from trainer.checkpoint import Checkpointer, read_ledger

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS_BEFORE_KILL = 3
START_TIMEOUT_S = 240.0
"""Loading torch, the model and joining the consumer group on two shared cores."""
FINISH_TIMEOUT_S = 300.0


def _write_config(tmp_path: Path, kafka_config, model_dir: Path) -> Path:
    overrides = {
        "paths": {"data_dir": str(tmp_path / "data")},
        "model": {"path": str(model_dir)},
        "kafka": kafka_config.model_dump(mode="json", exclude_none=True),
        "trainer": {"consumer_group": f"learner-{tmp_path.name}", "min_rollouts": 1, "max_rollouts_per_step": 1,
                    "poll_timeout_s": 0.1},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "register_every": 1000},
    }
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(overrides))
    return path


def _start(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "apps.cli", "--config", str(config), "learn"],
                            cwd=REPO_ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _wait_for_steps(ledger: Path, steps: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len({step for step, _ in read_ledger(ledger)}) >= steps:
            return
        if proc.poll() is not None:
            raise AssertionError(f"learner exited early with {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError(f"fewer than {steps} steps committed within {timeout_s} s")


def _wait_for_ids(ledger: Path, ids: set[str], proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ids <= {iid for _, iid in read_ledger(ledger)}:
            return
        if proc.poll() is not None:
            raise AssertionError(f"learner exited early with {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError(f"not every id trained on within {timeout_s} s")


@pytest.mark.kafka
def test_sigkill_mid_stream_then_restart_trains_every_rollout_exactly_once(tmp_path, kafka_config, tiny_model_dir):
    config = _write_config(tmp_path, kafka_config, tiny_model_dir)
    ledger = tmp_path / "data" / "checkpoints"
    log = tmp_path / "learner.log"
    traffic = sample_traffic(load_policy(tiny_model_dir), 40, prefix="x")
    backend = KafkaBackend(kafka_config)
    producer = backend.producer()
    produce(producer, kafka_config.topics, traffic[:10])

    def trickle() -> None:  # the stream goes on while the learner dies
        for interaction in traffic[10:]:
            produce(producer, kafka_config.topics, [interaction])
            time.sleep(0.1)

    first = _start(config, log)
    producer_thread = threading.Thread(target=trickle)
    try:
        _wait_for_steps(ledger, STEPS_BEFORE_KILL, first, START_TIMEOUT_S)
        producer_thread.start()
        time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    trained_before_kill = len(read_ledger(ledger))
    producer_thread.join()
    producer.close()
    assert first.returncode == -signal.SIGKILL
    assert trained_before_kill < len(traffic), "the kill must land mid-stream"

    second = _start(config, log)
    try:
        _wait_for_ids(ledger, {i.interaction_id for i in traffic}, second, FINISH_TIMEOUT_S)
        time.sleep(1.0)  # a wrongly repeated step would show up in the ledger now
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            second.kill()

    counts = Counter(iid for _, iid in read_ledger(ledger))
    assert set(counts) == {i.interaction_id for i in traffic}
    assert [iid for iid, n in counts.items() if n != 1] == []
    last = Checkpointer(ledger).load_latest()
    assert last.state.step == len(traffic)  # one rollout per step, none lost, none repeated
    assert last.state.joiner["counters"]["duplicate_interactions"] == 0
