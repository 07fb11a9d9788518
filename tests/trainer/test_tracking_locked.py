"""The learner's SQLite tracking store locked by another writer past SQLite's busy timeout (the arms of a
``simulate`` sharing one ``mlflow.db``, ``mlflow gc``, a backup).

MLflow's store turns SQLite's "database is locked" into an MlflowException (TEMPORARILY_UNAVAILABLE). A
second sqlite3 connection holds ``BEGIN EXCLUSIVE`` on the tracker's database here, for real; MLflow
fixes its busy timeout at 20 s (``PRAGMA busy_timeout = 20000`` on each session, no setting), so the
test rewrites that pragma to 100 ms at the driver. Metrics must be kept and sent once the lock is
released; a registry call must wait for the lock and succeed after it.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
import time

import pytest
import torch
from mlflow import MlflowClient
from sqlalchemy import event
from sqlalchemy.engine import Engine

import trainer.tracking as tracking
from online_sao.weights import FileWeightStore
from tests.fixtures.mlflow import tracker_config
from trainer.tracking import RunTracker

BUSY_TIMEOUT_MS = 100


def _short_busy_timeout(conn, cursor, statement, parameters, context, executemany):
    return re.sub(r"PRAGMA busy_timeout = \d+", f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}", statement), parameters


@pytest.fixture
def short_busy_timeout(monkeypatch):
    """SQLite waits 100 ms for a lock instead of MLflow's 20 s; the tracker's pause between tries 0.2 s."""
    event.listen(Engine, "before_cursor_execute", _short_busy_timeout, retval=True)
    monkeypatch.setattr(tracking, "TRACKING_RETRY_S", 0.2)
    yield
    event.remove(Engine, "before_cursor_execute", _short_busy_timeout)


class Lock:
    """Another writer: a second connection holding SQLite's exclusive lock on the database."""

    def __init__(self, db: str) -> None:
        self.connection = sqlite3.connect(db, isolation_level=None)

    def hold(self) -> None:
        self.connection.execute("BEGIN EXCLUSIVE")

    def release(self) -> None:
        self.connection.execute("COMMIT")


def test_a_locked_database_keeps_the_metrics_and_sends_them_once_it_is_released(
        short_busy_timeout, tmp_path, caplog):
    cfg = tracker_config(tmp_path)
    tracker = RunTracker(cfg, stop=threading.Event())
    tracker.log_metrics({"reward_mean": 0.1}, step=1)
    lock = Lock(str(tmp_path / "mlflow.db"))

    lock.hold()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        for step in (2, 3):
            tracker.log_metrics({"reward_mean": 0.1 * step}, step=step)  # no raise: kept
    assert time.monotonic() - started < 5  # the learner goes on
    assert tracker.unlogged_steps == 2
    named = [r.message for r in caplog.records if "locked" in r.message]
    assert len(named) == 1 and str(tmp_path / "mlflow.db") in named[0]

    lock.release()
    time.sleep(0.3)
    tracker.log_metrics({"reward_mean": 0.4}, step=4)
    assert tracker.unlogged_steps == 0
    tracker.close()
    history = MlflowClient(tracking_uri=cfg.mlflow_uri).get_metric_history(tracker.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]


def test_a_registry_call_waits_for_a_locked_database_and_succeeds_once_it_is_released(
        short_busy_timeout, tmp_path, caplog):
    cfg = tracker_config(tmp_path)
    tracker = RunTracker(cfg, stop=threading.Event())
    ref = FileWeightStore(str(tmp_path / "weights")).save(1, {"w": torch.ones(2)})
    lock = Lock(str(tmp_path / "mlflow.db"))

    lock.hold()
    registered: list[str] = []
    failed: list[BaseException] = []

    def register() -> None:
        try:
            registered.append(tracker.registry.register(ref, 0.4))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failed.append(exc)

    with caplog.at_level(logging.WARNING):
        waiting = threading.Thread(target=register)
        waiting.start()
        waiting.join(1.5)
        assert waiting.is_alive() and not registered and not failed  # waits for the lock
        lock.release()
        waiting.join(30)
    assert not failed and registered == ["1"]
    assert any("locked" in r.message and str(tmp_path / "mlflow.db") in r.message for r in caplog.records)
    assert tracker.registry.candidate()[0] == 1

    lock.hold()
    champion: list = []
    waiting = threading.Thread(target=lambda: champion.append(tracker.registry.champion()))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive()  # a read waits too
    lock.release()
    waiting.join(30)
    assert champion == [None]
    tracker.close()


def test_only_a_lock_of_a_sqlite_store_is_waited_for_a_database_servers_operational_errors_all_are():
    """MLflow raises every OperationalError of its SQL store as TEMPORARILY_UNAVAILABLE (built here as MLflow
    builds it); on SQLite only a lock passes with time, a database server's errors (a lost connection) do."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
    from sqlalchemy.exc import OperationalError

    from trainer.mlflow_store import TrackingUnavailable, is_temporarily_unavailable, unavailable

    def raised(text: str) -> MlflowException:
        driver = OperationalError("SELECT 1", {}, sqlite3.OperationalError(text))
        return MlflowException(message=driver, error_code=TEMPORARILY_UNAVAILABLE)

    sqlite = "sqlite:////data/mlflow.db"
    assert is_temporarily_unavailable(raised("database is locked"), sqlite)
    assert not is_temporarily_unavailable(raised("no such table: runs"), sqlite)
    assert not is_temporarily_unavailable(raised("attempt to write a readonly database"), sqlite)
    assert is_temporarily_unavailable(raised("server closed the connection unexpectedly"), "postgresql://db/mlflow")
    why = unavailable(raised("database is locked"), sqlite)
    assert isinstance(why, TrackingUnavailable) and "/data/mlflow.db" in str(why) and "locked" in str(why)


def test_what_the_tracker_says_of_an_unavailable_store_masks_the_password_of_its_uri():
    """mlflow.tracking_uri may carry a database password (postgresql://user:pw@db/mlflow): config show and
    the learner's params mask it, and so do the messages the tracker logs while it waits."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    from trainer.mlflow_store import unavailable

    uri = "postgresql://mlflow:S3cretPw@db:5432/mlflow"
    lost = MlflowException(message=f"connection to {uri} lost", error_code=TEMPORARILY_UNAVAILABLE)
    said = str(unavailable(lost, uri))
    assert "S3cretPw" not in said and "postgresql://mlflow:***@db:5432/mlflow" in said
    refused = MlflowException(message="no answer from postgresql://mlflow:S3cretPw@db:5432/mlflow")
    assert "S3cretPw" not in str(unavailable(refused, uri))
