"""Opening MLflow: the tracking store (SQLite or a server), its experiments, and how long a
request to a server may take.

MLflow's client retries a server that does not answer for minutes (7 retries, 120 s each) and
reads its limits from the environment only; the learner bounds them
(:func:`bound_mlflow_requests`) and waits on its own terms (trainer/tracking.py).

A store with no room for a write (a full disk under the SQLite file, or under a server's) is an
``OSError`` ENOSPC naming it, and one whose disk failed the write otherwise (SQLite's "disk I/O
error": a full quota, EDQUOT, reads so) an ``OSError`` EIO naming it (:func:`store_refused`), like
the learner's other disk errors.

A SQLite database another writer holds locked past MLflow's busy timeout (SQLite's "database is
locked": the arms of a ``simulate`` sharing one ``mlflow.db``, ``mlflow gc``, a backup) is waited out as
an unreachable server is, as is a database server's operational error (:func:`is_temporarily_unavailable`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import ssl
from contextlib import contextmanager
from pathlib import Path

import httpx
import requests
from mlflow import MlflowClient
from mlflow.entities import LifecycleStage
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (INVALID_PARAMETER_VALUE, PERMISSION_DENIED, RESOURCE_ALREADY_EXISTS,
                                          RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE, UNAUTHENTICATED, ErrorCode)

from online_sao.config import Config, ConfigError
from online_sao.config.base import mask_uri_password
from online_sao.durable import is_disk_full, naming_the_file


def is_code(exc: MlflowException, code: int) -> bool:
    return exc.error_code == ErrorCode.Name(code)


MAX_VALUE_LENGTH = 6000
"""MLflow's limit on a parameter value; longer parameter and tag values are cut (the full YAML is an artifact)."""
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


class RunDeleted(TrackingUnavailable):
    """The learner's MLflow run, or its experiment, was deleted while it ran: MLflow takes nothing for
    the run until it is restored (:func:`deleted_run`)."""


def deleted_run(client: MlflowClient, run_id: str, exc: MlflowException) -> RunDeleted | None:
    """Why a write to run ``run_id`` failed with ``exc``, if it was because an operator deleted the run or
    its experiment (MLflow: "must be in the 'active' state"), or deleted it for good (``mlflow gc``): what
    happened and how to restore it. None for any other error, or when the run cannot be read to tell."""
    if not (is_code(exc, INVALID_PARAMETER_VALUE) or is_code(exc, RESOURCE_DOES_NOT_EXIST)):
        return None
    try:
        run = client.get_run(run_id)
        experiment = client.get_experiment(run.info.experiment_id)
    except MlflowException as probe:
        if not is_code(probe, RESOURCE_DOES_NOT_EXIST):
            return None
        return RunDeleted(f"the learner's MLflow run {run_id} no longer exists (deleted for good): MLflow takes no "
                          f"metrics for it, and the learner's next start logs to a new run")
    if run.info.lifecycle_stage != LifecycleStage.DELETED:
        return None
    if experiment.lifecycle_stage == LifecycleStage.DELETED:
        eid = experiment.experiment_id
        how = (f" with its experiment {eid}: MLflow takes no metrics for it until the experiment is restored (mlflow "
               f"experiments restore --experiment-id {eid}, which restores its runs)")
    else:
        how = f": MLflow takes no metrics for it until it is restored (mlflow runs restore --run-id {run_id})"
    return RunDeleted(f"the learner's MLflow run {run_id} was deleted{how}")


def is_unreachable(exc: MlflowException) -> bool:
    """Whether MLflow's client got no usable answer: none at all (connection refused, timed out), or
    only answers it retries (HTTP 5xx, 429) until its retries were spent (:func:`is_failing`)."""
    return isinstance(exc.__context__, requests.exceptions.RequestException)


SQLITE_BUSY = "database is locked"
"""SQLite's text for SQLITE_BUSY: another connection held the database's lock past MLflow's busy timeout
(20 s, fixed in MLflow); MLflow passes it on as an MlflowException (TEMPORARILY_UNAVAILABLE)."""

SQLITE_LOCKS = (SQLITE_BUSY, "database table is locked", "database schema is locked")
"""SQLite's texts for a lock another connection holds (SQLITE_BUSY, SQLITE_LOCKED)."""


def is_temporarily_unavailable(exc: MlflowException, uri: str) -> bool:
    """Whether MLflow's store at ``uri`` said it is temporarily unavailable (TEMPORARILY_UNAVAILABLE, what
    MLflow's SQL store raises for its driver's OperationalError): on SQLite, only when the database was
    locked by another writer past the busy timeout (:data:`SQLITE_LOCKS`), since its other operational
    errors ("no such table", "attempt to write a readonly database") do not pass with time; on a database
    server (PostgreSQL, MySQL), any (a lost connection, a restart). Waited out like :func:`is_unreachable`:
    check :func:`store_refused` first (a full disk reads so too, and is not waited for)."""
    if not is_code(exc, TEMPORARILY_UNAVAILABLE):
        return False
    return not uri.startswith("sqlite:") or any(text in exc.message for text in SQLITE_LOCKS)


def is_failing(exc: MlflowException) -> bool:
    """Whether MLflow's server answered, but only with errors its client retries until it gave up: the
    server is up and something under it failed. An artifact upload to a server whose artifact disk is
    full answers so (HTTP 500; the server's log has the ENOSPC, the answer does not)."""
    return isinstance(exc.__context__, requests.exceptions.RetryError)


def unavailable(exc: MlflowException, uri: str) -> TrackingUnavailable:
    """What the tracker waits out for an :func:`is_unreachable` or :func:`is_temporarily_unavailable` ``exc``,
    saying which it was (a locked SQLite database named as such)."""
    uri = mask_uri_password(uri)  # said in logs: a password in it is not
    if is_failing(exc):
        spent = exc.__context__.args[0] if exc.__context__.args else None  # urllib3's MaxRetryError
        request, why = getattr(spent, "url", "a request"), getattr(spent, "reason", exc.__context__)
        return TrackingUnavailable(f"MLflow at {uri} (mlflow.tracking_uri) answers {request} with server errors "
                                   f"({mask_uri_password(str(why))}; its client's retries spent): the server's "
                                   f"log says why, a full "
                                   f"artifact disk answers so")
    if not is_unreachable(exc) and is_temporarily_unavailable(exc, uri):
        where = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else uri
        if any(text in exc.message for text in SQLITE_LOCKS):
            return TrackingUnavailable(f"MLflow's SQLite database {where} (mlflow.tracking_uri) is locked: another "
                                       f"writer (a learner on the same database, mlflow gc, a backup) held it past "
                                       f"SQLite's busy timeout")
        first = mask_uri_password(exc.message.strip().splitlines()[0])[:300] if exc.message.strip() else "no message"
        return TrackingUnavailable(f"MLflow's store at {where} (mlflow.tracking_uri) is temporarily unavailable: "
                                   f"{first}")
    return TrackingUnavailable(f"MLflow at {uri} (mlflow.tracking_uri) does not answer: "
                               f"{mask_uri_password(exc.message)[:300]}")


UNAUTHORIZED, FORBIDDEN = 401, 403
"""The HTTP statuses of a server that refuses the credentials it was given (or that none were given),
and of one that refuses their user the request."""


def refused_credentials(uri: str, status: int) -> ConfigError:
    """What the learner stops with when its MLflow server at ``uri`` answered ``status``
    (:data:`UNAUTHORIZED`, :data:`FORBIDDEN`): one line naming the setting (its password masked),
    not MLflow's traceback. Time does not mend credentials, so nothing waits."""
    where = f"MLflow at {mask_uri_password(uri)} (mlflow.tracking_uri)"
    if status == FORBIDDEN:
        return ConfigError(f"{where} refuses its user this request (HTTP 403): give the user permission on the "
                           f"experiment mlflow.experiment and the model mlflow.registered_model, or set another user")
    return ConfigError(f"{where} refuses the credentials it was given (HTTP 401): set the server's user and password "
                       f"in mlflow.tracking_uri (http://user:password@host) or in MLFLOW_TRACKING_USERNAME and "
                       f"MLFLOW_TRACKING_PASSWORD")


def credentials_refused(exc: MlflowException, uri: str) -> ConfigError | None:
    """:func:`refused_credentials` when ``exc`` says the server refused the credentials or their user
    (UNAUTHENTICATED: HTTP 401, PERMISSION_DENIED: HTTP 403); None for any other error."""
    if is_code(exc, UNAUTHENTICATED):
        return refused_credentials(uri, UNAUTHORIZED)
    if is_code(exc, PERMISSION_DENIED):
        return refused_credentials(uri, FORBIDDEN)
    return None


SQLITE_FULL = "database or disk is full"
"""SQLite's text for SQLITE_FULL: a write to the database or its journal found no room (ENOSPC). MLflow
passes it on as an MlflowException (TEMPORARILY_UNAVAILABLE), a server in its answer's message."""

SQLITE_IOERR = "disk I/O error"
"""SQLite's text for SQLITE_IOERR: a read, write or sync of the database or its journal failed for
another reason than ENOSPC. SQLite keeps ENOSPC alone for SQLITE_FULL, so a full disk quota (EDQUOT)
reads as this, as does a failing device; MLflow passes it on as it does SQLITE_FULL."""

REFUSED_WRITES = {SQLITE_FULL: errno.ENOSPC, SQLITE_IOERR: errno.EIO}
"""The store's refusals that name the disk, and the OS error each is raised as."""


def store_refused(exc: MlflowException, uri: str) -> OSError | None:
    """The ``OSError`` to raise for ``exc`` when it says MLflow's store at ``uri`` could not write to
    its disk (ENOSPC: no room; EIO: any other disk error, a full quota among them), naming the SQLite
    file (a server: its URI); None for any other error. MLflow's own text names neither the file nor
    the disk, and is pages of SQL."""
    found = [text for text in REFUSED_WRITES if text in exc.message]
    if not found:
        return None
    where = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else mask_uri_password(uri)
    code = REFUSED_WRITES[found[0]]
    hint = "" if code == errno.ENOSPC else "; a full disk quota (EDQUOT) reads so too"
    return OSError(code, f"{os.strerror(code)} (MLflow's store: {found[0]}{hint})", where)


def artifact_root(cfg: Config) -> str | None:
    """Where a new experiment keeps artifacts: next to a SQLite store; the server decides otherwise."""
    return (cfg.data_dir / "mlflow-artifacts").as_uri() if cfg.mlflow_uri.startswith("sqlite:") else None


@contextmanager
def artifacts_named(artifact_uri: str):
    """An artifact write's OS error (a full disk's ENOSPC names no file) names where it was writing:
    the directory for a local artifact store, else its URI."""
    with naming_the_file(artifact_uri.removeprefix("file://")):
        yield


def disk_refused(exc: BaseException) -> bool:
    """A write its disk refused: no room (ENOSPC, EDQUOT) or another disk error (EIO, as the store raises
    SQLite's "disk I/O error", which a full quota reads as)."""
    return is_disk_full(exc) or (isinstance(exc, OSError) and exc.errno == errno.EIO)


class _WithoutFullStoreTracebacks(logging.Filter):
    """MLflow logs every SQL error with its traceback at ERROR before raising it: on a full disk (or a
    locked database), one per metrics write the tracker retries. The tracker names the refusing (or
    locked) store itself (trainer/tracking.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in (*REFUSED_WRITES, *SQLITE_LOCKS))


_WITHOUT_FULL_STORE_TRACEBACKS = _WithoutFullStoreTracebacks()


def _tls(creds) -> bool | ssl.SSLContext:
    """httpx's ``verify`` for MLflow's host credentials: off with ``MLFLOW_TRACKING_INSECURE_TLS``, else the
    server certificate (``MLFLOW_TRACKING_SERVER_CERT_PATH``) and client certificate
    (``MLFLOW_TRACKING_CLIENT_CERT_PATH``) it names, else the system's CAs."""
    if creds.ignore_tls_verification:
        return False
    if not (creds.server_cert_path or creds.client_cert_path):
        return True
    context = ssl.create_default_context(cafile=creds.server_cert_path)
    if creds.client_cert_path:
        context.load_cert_chain(creds.client_cert_path)
    return context


def probe_server(uri: str, timeout_s: float = TRACKING_PROBE_S) -> None:
    """Ask an MLflow server's ``/health``; TrackingUnavailable, naming the setting, when it does not answer,
    a ConfigError when it refuses the credentials (:func:`refused_credentials`).
    The URI's user and password go as basic auth beside a URL without them: httpx names the URL it asked
    in its log lines and errors. Otherwise it sends what MLflow's own client would, as MLflow reads it
    from the environment (:func:`mlflow.utils.credentials.get_default_host_creds`): basic auth when both
    user and password are set, else the token; its TLS settings too. A proxy that guards ``/health``
    refused a probe without them, and a private CA's certificate failed it, which MLflow's client took."""
    from mlflow.utils.credentials import get_default_host_creds

    url = httpx.URL(uri)
    creds = get_default_host_creds(uri)
    headers: dict[str, str] = {}
    auth = (url.username, url.password) if url.username or url.password else None
    if auth is None and creds.username and creds.password:
        auth = (creds.username, creds.password)
    elif auth is None and creds.token:
        headers["Authorization"] = f"Bearer {creds.token}"
    bare = str(url.copy_with(userinfo=b"")).rstrip("/")
    try:
        answer = httpx.get(f"{bare}/health", auth=auth, headers=headers, verify=_tls(creds), timeout=timeout_s)
        answer.raise_for_status()
    except httpx.HTTPError as exc:
        status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
        if status in (UNAUTHORIZED, FORBIDDEN):
            raise refused_credentials(uri, status) from None
        raise TrackingUnavailable(f"MLflow at {mask_uri_password(uri)} (mlflow.tracking_uri) does not answer: "
                                  f"{mask_uri_password(str(exc))}") from None


def open_client(uri: str) -> MlflowClient:
    """An MLflow client on ``uri`` for tracking and the registry. A SQLite store is created
    (directory, tables, migrations) under an exclusive lock on ``<db>.lock``: processes that open
    the same new store at once (seeds run in parallel) otherwise race in MLflow's migrations and
    fail ("Online migration expected to match one row")."""
    if uri.startswith(("http://", "https://")):
        probe_server(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    logging.getLogger("mlflow.store.db.utils").addFilter(_WITHOUT_FULL_STORE_TRACEBACKS)  # added once
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
    if found is not None and found.lifecycle_stage == LifecycleStage.DELETED:
        # a run cannot be made in it, and restoring it would also bring back the runs deleted with it
        raise ConfigError(
            f"the MLflow experiment {name!r} (id {found.experiment_id}) is deleted, and its name stays taken "
            f"until the deletion is made permanent: restore it (mlflow experiments restore --experiment-id "
            f"{found.experiment_id}), delete it for good (mlflow gc), or name another (mlflow.experiment)")
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as exc:  # another process created it between our two calls
        if not is_code(exc, RESOURCE_ALREADY_EXISTS):
            raise
        return client.get_experiment_by_name(name).experiment_id
