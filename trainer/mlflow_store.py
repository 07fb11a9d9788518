"""Opening MLflow: the tracking store (SQLite or a server), its experiments, and how long a
request to a server may take.

MLflow's client retries a server that does not answer for minutes (7 retries, 120 s each) and
reads its limits from the environment only; the learner bounds them
(:func:`bound_mlflow_requests`) and waits on its own terms (trainer/tracking.py).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import httpx
import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode


def is_code(exc: MlflowException, code: int) -> bool:
    return exc.error_code == ErrorCode.Name(code)


TRACKING_PROBE_S = 10.0
"""How long the first request to an MLflow server may take before it counts as unreachable: MLflow's
own client retries an unreachable server for minutes, deaf to a SIGTERM meanwhile."""


MLFLOW_REQUEST_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
"""One MLflow request, its own retries included, gives up within about 35 s (3 x 10 s, 1 + 2 s of
back-off) instead of MLflow's default of minutes (7 retries, 120 s each): the learner waits on its
own terms, between attempts it can be stopped."""


def bound_mlflow_requests(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set :data:`MLFLOW_REQUEST_BOUNDS` where the operator has not (MLflow reads these from the
    environment only). Called by the learner's entry point; returns what it set."""
    env = os.environ if environ is None else environ
    added = {name: value for name, value in MLFLOW_REQUEST_BOUNDS.items() if name not in env}
    env.update(added)
    return added


class TrackingUnavailable(RuntimeError):
    """The MLflow server does not answer."""


def is_unreachable(exc: MlflowException) -> bool:
    """Whether MLflow's client failed to get any answer (connection refused, timed out, retries spent)."""
    return isinstance(exc.__context__, requests.exceptions.RequestException)


def probe_server(uri: str, timeout_s: float = TRACKING_PROBE_S) -> None:
    """Ask an MLflow server's ``/health``; TrackingUnavailable, naming the setting, when it does not answer."""
    try:
        httpx.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise TrackingUnavailable(f"MLflow at {uri} (mlflow.tracking_uri) does not answer: {exc}") from None


def open_client(uri: str) -> MlflowClient:
    """An MLflow client on ``uri`` for tracking and the registry. A SQLite store is created
    (directory, tables, migrations) under an exclusive lock on ``<db>.lock``: processes that open
    the same new store at once (seeds run in parallel) otherwise race in MLflow's migrations and
    fail ("Online migration expected to match one row")."""
    if uri.startswith(("http://", "https://")):
        probe_server(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # may create the tables itself
        client.search_experiments(max_results=1)        # creates or checks the tracking tables
        client.search_registered_models(max_results=1)  # and the registry's
    return client


def experiment_id(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment ``name``, created if missing (by whichever process gets there first)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as exc:  # another process created it between our two calls
        if not is_code(exc, RESOURCE_ALREADY_EXISTS):
            raise
        return client.get_experiment_by_name(name).experiment_id
