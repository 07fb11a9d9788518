"""The learner's tracker when a real MLflow server stops answering mid-run (a relay is cut)."""

from __future__ import annotations

import http.server
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
    waiting = threading.Thread(target=lambda: registered.append(tracker.registry.register(ref, 0.4)))
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
        tracker.registry.champion()
    assert time.monotonic() - started < 5  # a stop request is not deaf to the outage
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        tracker.close("KILLED")  # no raise: named in the log with what was missed
    assert any("1 steps of metrics not logged" in r.message for r in caplog.records)
    relay.up()
    run = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server}").get_run(tracker.run_id)
    assert run.info.status == "RUNNING"


def _model_dirs(mlflow_root) -> set[str]:
    """The registered model directories the server's proxied artifact store holds."""
    return {d.name for d in (mlflow_root / "artifacts").glob("*/*/artifacts/policy/v*") if d.is_dir()}


def _pruned(uri: str, cfg) -> dict[int, str]:
    found = MlflowClient(tracking_uri=uri, registry_uri=uri).search_model_versions(
        f"name = '{cfg.mlflow.registered_model}'")
    return {int(v.tags["policy_version"]): v.tags["weights_pruned"] for v in found}


def test_a_proxied_server_deletes_pruned_artifacts_and_an_outage_leaves_them_to_the_next_registration(
        mlflow_server, free_port, quick, tmp_path, caplog):
    """``mlflow server --artifacts-destination`` (docs/deploy): the learner deletes pruned model
    directories through the server. While the server does not answer, neither the pruning nor the
    windowed metrics hold the learner up: the pruning is done at the next registration, the
    metrics are sent when the server answers."""
    direct = f"http://127.0.0.1:{mlflow_server}"
    relay = Relay(free_port, ("127.0.0.1", mlflow_server))
    cfg = _config(tmp_path, relay.url)
    cfg.mlflow.keep_registered_artifacts, cfg.mlflow.log_every_steps = 1, 2
    tracker = RunTracker(cfg, stop=threading.Event())
    store = FileWeightStore(str(tmp_path / "weights"))
    refs = {v: store.save(v, {"w": torch.full((2,), float(v))}) for v in range(1, 6)}
    tracker.registry.register(refs[1], 0.0)
    tracker.registry.record_decision("promoted", {"gate.decision": "no_champion"}, refs[1])
    for version in (2, 3, 4):
        tracker.registry.register(refs[version], 0.0)
    root = tmp_path / "mlflow-server"
    assert _model_dirs(root) == {"v00000001", "v00000004"}  # the champion and the newest
    assert _pruned(direct, cfg) == {1: "false", 2: "true", 3: "true", 4: "false"}

    MlflowClient(tracking_uri=direct, registry_uri=direct).set_registered_model_alias(
        cfg.mlflow.registered_model, "champion", "4")  # v1 may go now
    relay.down()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        tracker.registry.prune_registered()
        for step in (1, 2, 3):
            tracker.log_step(step, averaged={"value_loss": float(step)}, latest={"policy_version": float(step)})
    assert time.monotonic() - started < 15  # the learner goes on
    assert "pruned at the next registration" in caplog.text
    assert _model_dirs(root) == {"v00000001", "v00000004"} and tracker.unlogged_steps == 1
    relay.up()
    tracker.registry.register(refs[5], 0.0)
    assert _model_dirs(root) == {"v00000004", "v00000005"}
    assert _pruned(direct, cfg) == {1: "true", 2: "true", 3: "true", 4: "false", 5: "false"}
    tracker.close()
    history = MlflowClient(tracking_uri=direct).get_metric_history(tracker.run_id, "value_loss")
    assert [(m.step, m.value) for m in history] == [(2, 1.5), (3, 3.0)]


class _RefusingProxy:
    """An HTTP proxy in front of the MLflow server that answers every artifact deletion with 403,
    as an ingress or an auth layer that does not allow DELETE would."""

    def __init__(self, port: int, target: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                if self.command == "DELETE" and "/mlflow-artifacts/artifacts/" in self.path:
                    body = b"deletion of artifacts is not allowed here"
                    self.send_response(403)
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                    answer = httpx.request(self.command, target + self.path, headers=headers,
                                           content=self.rfile.read(length), timeout=30)
                    body = answer.content
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in _HOP_HEADERS:
                            self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"


_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


def test_a_server_that_refuses_deletion_is_named_once_and_registration_goes_on(
        mlflow_server, free_port, tmp_path, caplog):
    proxy = _RefusingProxy(free_port, f"http://127.0.0.1:{mlflow_server}")
    try:
        cfg = _config(tmp_path, proxy.url)
        cfg.mlflow.keep_registered_artifacts = 1
        tracker = RunTracker(cfg, stop=threading.Event())
        store = FileWeightStore(str(tmp_path / "weights"))
        with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
            for version in (1, 2, 3, 4):
                tracker.registry.register(store.save(version, {"w": torch.full((2,), float(version))}), 0.0)
        refused = [r.getMessage() for r in caplog.records if "retention is off" in r.getMessage()]
        assert len(refused) == 1 and "403" in refused[0] and "not allowed" in refused[0], refused
        assert _model_dirs(tmp_path / "mlflow-server") == {f"v0000000{v}" for v in (1, 2, 3, 4)}
        assert set(_pruned(proxy.url, cfg).values()) == {"false"}  # nothing claims to be gone
        assert tracker.registry.candidate()[0] == 4
        tracker.close()
    finally:
        proxy.server.shutdown()


def test_a_server_whose_artifact_store_fails_is_named_as_failing_and_registration_goes_on_once_fixed(
        mlflow_server, quick, tmp_path, caplog):
    """A server whose artifact store fails under it (a full artifact disk: HTTP 500, the ENOSPC only
    in the server's log; here a file where the version's directory goes, which answers alike) is
    waited for like an outage, but named as answering with errors: the log said "does not answer",
    sending the operator to the network (measured on a 64 KiB tmpfs under the server's artifacts)."""
    cfg = _config(tmp_path, f"http://127.0.0.1:{mlflow_server}")
    tracker = RunTracker(cfg, stop=threading.Event())
    store = FileWeightStore(str(tmp_path / "weights"))
    tracker.registry.register(store.save(1, {"w": torch.ones(2)}), 0.0)
    run = MlflowClient(tracking_uri=cfg.mlflow_uri).get_run(tracker.run_id)
    in_the_way = (tmp_path / "mlflow-server/artifacts" / run.info.experiment_id / tracker.run_id
                  / "artifacts/policy/v00000002")
    in_the_way.write_text("not a directory")
    registered: list[str] = []
    with caplog.at_level(logging.WARNING):
        waiting = threading.Thread(target=lambda: registered.append(
            tracker.registry.register(store.save(2, {"w": torch.full((2,), 2.0)}), 0.0)))
        waiting.start()
        waiting.join(5)
        assert waiting.is_alive() and not registered  # waited for, like a server that does not answer
        in_the_way.unlink()  # the operator made room
        waiting.join(30)
    assert registered == ["2"] and tracker.registry.candidate()[0] == 2
    named = [m for m in (r.getMessage() for r in caplog.records) if "v00000002/" in m and "with server errors" in m]
    assert len(named) == 1 and "500" in named[0] and "does not answer" not in caplog.text, caplog.text[-2000:]
    tracker.close()
