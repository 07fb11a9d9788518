"""The learner's tracker when a real MLflow server stops answering mid-run (a relay is cut)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from mlflow import MlflowClient

import trainer.tracking as tracking
from online_sao.config import load_config
from online_sao.weights import FileWeightStore
from tests.fixtures.relay import Relay
from trainer.mlflow_store import MLFLOW_REQUEST_BOUNDS, TrackingUnavailable, bound_mlflow_requests
from trainer.tracking import RunTracker

SERVER_START_S = 120


@pytest.fixture
def mlflow_server(tmp_path, free_port_factory):
    """A real ``mlflow server`` on SQLite (port, process)."""
    root = tmp_path / "mlflow-server"
    root.mkdir()
    port = free_port_factory()
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "wb"),
        start_new_session=True)
    deadline = time.monotonic() + SERVER_START_S
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-2000:]
        time.sleep(0.5)
    yield port
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(30)


@pytest.fixture
def quick(monkeypatch):
    """MLflow's requests bounded to one try of 3 s; the tracker's pause between tries 0.2 s."""
    for name, value in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tracking, "TRACKING_RETRY_S", 0.2)


def _config(tmp_path, uri: str):
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data"), "mlflow.tracking_uri": uri})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    return cfg


def test_the_learner_bounds_mlflows_requests_unless_the_operator_did():
    environ = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}
    added = bound_mlflow_requests(environ)
    assert environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "60"
    assert added == {k: v for k, v in MLFLOW_REQUEST_BOUNDS.items() if k != "MLFLOW_HTTP_REQUEST_TIMEOUT"}
    assert environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"


def test_an_mlflow_outage_keeps_metrics_waits_for_the_registry_and_a_stop_ends_the_wait(
        mlflow_server, free_port, quick, tmp_path, caplog):
    relay = Relay(free_port, ("127.0.0.1", mlflow_server))
    stop = threading.Event()
    tracker = RunTracker(_config(tmp_path, relay.url), stop=stop)
    tracker.log_metrics({"reward_mean": 0.1}, step=1)

    relay.down()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        for step in (2, 3, 4):
            tracker.log_metrics({"reward_mean": 0.1 * step}, step=step)
    assert time.monotonic() - started < 10  # the learner goes on
    assert tracker.unlogged_steps == 3
    assert sum("does not answer" in r.message for r in caplog.records) == 1

    store = FileWeightStore(str(tmp_path / "weights"))
    ref = store.save(1, {"w": torch.ones(2)})
    registered: list[str] = []
    waiting = threading.Thread(target=lambda: registered.append(tracker.register(ref, 0.4)))
    waiting.start()
    waiting.join(2)
    assert waiting.is_alive() and not registered  # the registry call waits for the server
    relay.up()
    waiting.join(30)
    assert registered == ["1"]
    tracker.log_metrics({"reward_mean": 0.5}, step=5)
    time.sleep(0.3)
    tracker.log_metrics({"reward_mean": 0.6}, step=6)
    assert tracker.unlogged_steps == 0
    history = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server}").get_metric_history(
        tracker.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]

    relay.down()
    tracker.log_metrics({"reward_mean": 0.7}, step=7)
    stop.set()
    started = time.monotonic()
    with pytest.raises(TrackingUnavailable, match="does not answer"):
        tracker.champion()
    assert time.monotonic() - started < 5  # a stop request is not deaf to the outage
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        tracker.close("KILLED")  # no raise: named in the log with what was missed
    assert any("1 steps of metrics not logged" in r.message for r in caplog.records)
    relay.up()
    run = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server}").get_run(tracker.run_id)
    assert run.info.status == "RUNNING"
