"""The MLflow server's password (``mlflow.tracking_uri=http://user:password@host``) stays out of the
learner's log lines and errors, and a server that refuses the credentials stops the learner with one
line naming the setting."""

from __future__ import annotations

import http.server
import logging
import threading
from contextlib import contextmanager

import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, RESOURCE_DOES_NOT_EXIST

from online_sao.config import ConfigError, load_config
from online_sao.weights import WeightsRef
from tests.fixtures.mlflow import tracker_config
from trainer import registry_versions
from trainer.mlflow_store import probe_server
from trainer.registry import PolicyRegistry
from trainer.tracking import RunTracker

PASSWORD = "MLPW-SECRET-444"


def _uri(port: int) -> str:
    return f"http://mluser:{PASSWORD}@127.0.0.1:{port}"


@contextmanager
def mlflow_server(port: int, status: int, health: int = 200):
    """A stand-in MLflow server on ``port``: ``/health`` answers ``health``, every API call ``status`` (as
    MLflow's basic-auth server answers wrong credentials: not JSON). Yields the Authorization headers it got."""
    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(health if self.path == "/health" else status)
            self.end_headers()
            self.wfile.write(b"OK" if self.path == "/health" else b"You are not authenticated.")

        do_GET = do_POST = do_PATCH = do_DELETE = _answer

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_health_probe_logs_no_password(free_port, caplog):
    """httpx logged ``HTTP Request: GET http://user:password@host/health`` at INFO on every learner start."""
    for name in (None, "httpx", "httpcore"):  # whatever an earlier test's logging set-up turned down
        caplog.set_level(logging.DEBUG, logger=name)
    with mlflow_server(free_port, 200) as seen:
        probe_server(_uri(free_port))
    assert caplog.records and PASSWORD not in caplog.text
    assert seen and seen[0].startswith("Basic ")  # the credentials still go, as basic auth


def test_a_probe_refused_for_its_credentials_names_the_setting(free_port):
    with mlflow_server(free_port, 401, health=401), pytest.raises(ConfigError) as raised:
        probe_server(_uri(free_port))
    assert "mlflow.tracking_uri" in str(raised.value) and "mluser:***@" in str(raised.value)
    assert PASSWORD not in str(raised.value)


@pytest.mark.parametrize("environment, header", [
    ({"MLFLOW_TRACKING_USERNAME": "mluser", "MLFLOW_TRACKING_PASSWORD": "pw"}, "Basic bWx1c2VyOnB3"),
    ({"MLFLOW_TRACKING_TOKEN": "tok"}, "Bearer tok"),
    # MLflow's client sends basic auth only with both: a stray user beside a token is the token
    ({"MLFLOW_TRACKING_TOKEN": "tok", "MLFLOW_TRACKING_USERNAME": "svc"}, "Bearer tok"),
])
def test_a_uri_without_credentials_probes_with_those_mlflow_s_client_reads(free_port, monkeypatch, environment,
                                                                           header):
    """A proxy guarding /health as well refused the probe the environment's credentials, which MLflow's
    client then sends: the learner stopped, told to set exactly those variables."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with mlflow_server(free_port, 200) as seen:
        probe_server(f"http://127.0.0.1:{free_port}")
    assert seen == [header]


def test_the_probe_takes_mlflow_s_tls_settings(monkeypatch):
    """A self-signed server with MLFLOW_TRACKING_INSECURE_TLS: MLflow's client answered, the probe said
    the server did not answer, and the learner waited for ever."""
    from mlflow.utils.credentials import get_default_host_creds

    from trainer.mlflow_store import _tls

    assert _tls(get_default_host_creds("https://mlflow.example")) is True
    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    assert _tls(get_default_host_creds("https://mlflow.example")) is False


def test_wrong_credentials_stop_the_tracker_with_one_line_naming_the_setting(tmp_path, free_port):
    """A 401 from the server was re-raised as MLflow's exception: a 22-frame traceback."""
    cfg = tracker_config(tmp_path, **{"mlflow.tracking_uri": _uri(free_port)})
    with mlflow_server(free_port, 401), pytest.raises(ConfigError, match="refuses the credentials") as raised:
        RunTracker(cfg, run_id="46b08147ad39416a82ce54b0841d71e5", stop=threading.Event())
    assert "(mlflow.tracking_uri)" in str(raised.value) and "mluser:***@" in str(raised.value)
    assert PASSWORD not in str(raised.value)


def test_a_forbidden_request_names_the_user_s_permission():
    from trainer.mlflow_store import credentials_refused

    refused = credentials_refused(MlflowException("denied", error_code=PERMISSION_DENIED), _uri(5000))
    assert isinstance(refused, ConfigError) and "HTTP 403" in str(refused) and PASSWORD not in str(refused)
    assert credentials_refused(MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST), _uri(5000)) is None


def test_a_missing_checkpoint_run_is_logged_without_the_password(caplog):
    class Lost:
        def get_run(self, run_id):
            raise MlflowException(f"Run '{run_id}' not found", error_code=RESOURCE_DOES_NOT_EXIST)

    tracker = RunTracker.__new__(RunTracker)  # only the reopening is under test
    tracker.cfg, tracker.client = load_config(environ={}, overrides={"mlflow.tracking_uri": _uri(5000)}), Lost()
    with caplog.at_level(logging.WARNING):
        assert tracker._reopenable("46b08147") is None
    assert "does not exist on http://mluser:***@127.0.0.1:5000" in caplog.text and PASSWORD not in caplog.text


def _refusal_naming_the_url() -> requests.HTTPError:
    """What requests raises for a proxied artifact server's refusal: its text quotes the URL, user:password in it."""
    return requests.HTTPError(f"403 Client Error: Forbidden for url: {_uri(5000)}/api/2.0/mlflow-artifacts/"
                              f"artifacts/1/x/policy/v1")


def test_a_refused_pruning_is_logged_without_the_password(caplog):
    registry = PolicyRegistry.__new__(PolicyRegistry)  # only the pruning is under test
    registry._pruning_refused = False
    registry.answered = lambda what, action, wait=True: action()

    class Refusing:
        def prune(self):
            raise _refusal_naming_the_url()

    registry.retention = Refusing()
    with caplog.at_level(logging.WARNING):
        registry.prune_registered()
    assert "retention is off" in caplog.text and "mluser:***@" in caplog.text and PASSWORD not in caplog.text


def test_an_undone_registration_is_logged_without_the_password(monkeypatch, caplog):
    class Refusing:
        def delete_artifacts(self, name):
            raise MlflowException(f"API request to {_uri(5000)}/api/2.0/mlflow-artifacts/artifacts/x failed")

    monkeypatch.setattr(registry_versions, "get_artifact_repository", lambda parent, tracking_uri: Refusing())
    with caplog.at_level(logging.WARNING):
        registry_versions.unregister(None, "online-sao-policy", WeightsRef(3, "file:///weights/v3", "abc"), "mlflow-artifacts:/1/x/v3",
                                     None, _uri(5000))
    assert "is left" in caplog.text and "mluser:***@" in caplog.text and PASSWORD not in caplog.text
