"""The learner's MLflow store (SQLite database and artifact directory) when its disk fills up.

Measured on a real 8 MiB tmpfs (docs/RELIABILITY.md, "The learner's disk full"); CI cannot mount,
so here the database refuses its writes as SQLite does on a full disk (the driver raises
``sqlite3.OperationalError: database or disk is full``, which SQLAlchemy and MLflow wrap as they
do the real one), and an artifact file is a link to /dev/full (the kernel's own ENOSPC). Metrics
must be kept and sent once there is room; a registry write must stop the learner with an OS error
naming the full file, leave no registry version without its alias and no partial model directory,
and a restart once there is room must go on from the last checkpoint.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from sqlalchemy import event
from sqlalchemy.engine import Engine

import trainer.tracking as tracking
from online_sao.config import load_config
from online_sao.modeling import load_policy
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from tests.trainer.test_learner_memory import _config as learner_config
from tests.trainer.traffic import FillBefore, produce, sample_traffic
from trainer.checkpoint import read_ledger
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train
from trainer.tracking import RunTracker

WRITES = ("INSERT", "UPDATE", "DELETE")


class FullDatabase:
    """While :attr:`refused` says so, every SQLite statement that writes fails at the driver as on a
    full disk (reads go on, as they do on a full disk)."""

    def __init__(self) -> None:
        self.refused = lambda statement: False
        self.message = "database or disk is full"

    def fill(self, *starts: str, message: str = "database or disk is full") -> None:
        """Refuse the writes (those whose SQL starts with one of ``starts``, by default all of them)
        with SQLite's ``message``: its "disk I/O error" is what a full disk quota (EDQUOT) reads as."""
        self.refused = lambda statement: statement.lstrip().upper().startswith(starts or WRITES)
        self.message = message

    def free(self) -> None:
        self.refused = lambda statement: False

    def __call__(self, cursor, statement, parameters, context) -> None:
        if self.refused(statement):
            raise sqlite3.OperationalError(self.message)


@pytest.fixture
def database():
    full = FullDatabase()
    for name in ("do_execute", "do_executemany"):
        event.listen(Engine, name, full)
    yield full
    for name in ("do_execute", "do_executemany"):
        event.remove(Engine, name, full)


def _tracker_config(tmp_path: Path):
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data")})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    return cfg


def _db(cfg) -> str:
    return cfg.mlflow_uri.removeprefix("sqlite:///")


def _client(cfg) -> MlflowClient:
    return MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)


REFUSALS = [("database or disk is full", errno.ENOSPC), ("disk I/O error", errno.EIO)]
"""SQLite's two refusals of a write by its disk, and the OS error the tracker raises for each."""


@pytest.mark.parametrize("message", [m for m, _ in REFUSALS])
def test_metrics_on_a_full_store_are_kept_named_once_and_sent_once_there_is_room(
        tmp_path, database, monkeypatch, caplog, message):
    monkeypatch.setattr(tracking, "TRACKING_RETRY_S", 0.0)
    cfg = _tracker_config(tmp_path)
    tracker = RunTracker(cfg, stop=threading.Event())
    tracker.log_metrics({"reward_mean": 0.1}, step=1)
    database.fill(message=message)
    with caplog.at_level(logging.WARNING):
        for step in (2, 3, 4):
            tracker.log_metrics({"reward_mean": 0.1 * step}, step=step)  # no raise: the learner goes on
    assert tracker.unlogged_steps == 3
    named = [r.getMessage() for r in caplog.records if "cannot write to its disk" in r.getMessage()]
    assert len(named) == 1 and repr(_db(cfg)) in named[0] and message in named[0], named
    # MLflow's own ERROR with its traceback, once per failed write, is left out
    assert not [r for r in caplog.records if r.name.startswith("mlflow") and r.levelno >= logging.WARNING]
    database.free()
    tracker.log_metrics({"reward_mean": 0.5}, step=5)
    assert tracker.unlogged_steps == 0
    history = _client(cfg).get_metric_history(tracker.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("message", [m for m, _ in REFUSALS])
def test_closing_on_a_full_store_names_it_and_leaves_the_run_open(tmp_path, database, caplog, message):
    cfg = _tracker_config(tmp_path)
    tracker = RunTracker(cfg, stop=threading.Event())
    database.fill(message=message)
    tracker.log_metrics({"reward_mean": 0.1}, step=1)
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        tracker.close("FAILED")  # in the learner's finally: raising would hide the learner's own error
    assert any("1 steps of metrics not logged" in r.getMessage() and repr(_db(cfg)) in r.getMessage()
               for r in caplog.records)
    database.free()
    assert _client(cfg).get_run(tracker.run_id).info.status == "RUNNING"


def _registered(cfg) -> dict[int, str]:
    """Policy version -> registry version of every registry version."""
    found = _client(cfg).search_model_versions(f"name = '{cfg.mlflow.registered_model}'")
    return {int(v.tags["policy_version"]): str(v.version) for v in found}


def _model_dirs(cfg, tracker: RunTracker) -> list[str]:
    root = Path(_client(cfg).get_run(tracker.run_id).info.artifact_uri.removeprefix("file://")) / "policy"
    return sorted(p.name for p in root.iterdir())


def test_a_registration_whose_copy_finds_no_room_leaves_no_version_and_no_partial_directory(tmp_path):
    cfg = _tracker_config(tmp_path)
    tracker = RunTracker(cfg, stop=threading.Event())
    store = FileWeightStore(str(tmp_path / "weights"))
    tracker.registry.register(store.save(1, {"w": torch.ones(2)}), 0.1)
    target = Path(_client(cfg).get_run(tracker.run_id).info.artifact_uri.removeprefix("file://")) / "policy/v00000002"
    target.mkdir()
    (target / "model.safetensors").symlink_to("/dev/full")  # the weights do not fit; config.json may

    started = time.monotonic()
    with pytest.raises(OSError) as failure:
        tracker.registry.register(store.save(2, {"w": torch.full((2,), 2.0)}), 0.2)
    assert time.monotonic() - started < 5  # a full disk is not waited for like a server that does not answer
    assert failure.value.errno == errno.ENOSPC and str(target) in str(failure.value)
    assert _model_dirs(cfg, tracker) == ["v00000001"]  # the partial directory is gone, holding no space
    assert _registered(cfg) == {1: "1"} and tracker.registry.candidate()[0] == 1


@pytest.mark.parametrize("message, code", REFUSALS)
@pytest.mark.parametrize("delete_refused", [False, True])
def test_a_registration_whose_alias_finds_no_room_leaves_no_version_the_gate_or_serving_uses(
        tmp_path, database, delete_refused, caplog, message, code):
    cfg = _tracker_config(tmp_path)
    tracker = RunTracker(cfg, stop=threading.Event())
    store = FileWeightStore(str(tmp_path / "weights"))
    first = store.save(1, {"w": torch.ones(2)})
    tracker.registry.register(first, 0.1)
    tracker.registry.record_decision("promoted", {"gate.decision": "no_champion"}, first)
    # the version and its tags fit, the alias not (and, when the disk is still full, not its deletion:
    # MLflow marks a deleted version with an update)
    database.fill("INSERT INTO REGISTERED_MODEL_ALIASES", "UPDATE REGISTERED_MODEL_ALIASES",
                  *(("UPDATE MODEL_VERSIONS", "DELETE") if delete_refused else ()), message=message)
    with caplog.at_level(logging.WARNING), pytest.raises(OSError) as failure:
        tracker.registry.register(store.save(2, {"w": torch.full((2,), 2.0)}), 0.2)
    database.free()

    assert (failure.value.errno, failure.value.filename) == (code, _db(cfg))
    assert tracker.registry.candidate()[0] == 1 and tracker.registry.champion()[0] == 1
    assert _model_dirs(cfg, tracker) == ["v00000001"]
    if delete_refused:  # left, named, and read by nothing: no alias points at it
        assert _registered(cfg) == {1: "1", 2: "2"}
        assert any("version 2 (policy v2)" in r.getMessage() for r in caplog.records)
    else:
        assert _registered(cfg) == {1: "1"}


INTERACTIONS = 12
PER_STEP = 2
FULL_BEFORE_STEP = 3


def test_the_learner_stops_naming_the_full_store_and_a_restart_goes_on(tmp_path, tiny_model_dir, database):
    """Steps 1 and 2 register and decide; from step 3 on the database is full: the learner keeps
    step 3's gate metrics, stops at the gate's decision with the database named, closes without
    hiding that error, and leaves the registry as step 2 left it. Restarted once there is room,
    it goes on from step 2's checkpoint in the same MLflow run, every interaction trained once."""
    cfg = learner_config(tmp_path, tiny_model_dir, **{"trainer.min_rollouts": PER_STEP,
                                                      "trainer.max_rollouts_per_step": PER_STEP,
                                                      "mlflow.register_every": 1, "mlflow.log_every_steps": 1})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    traffic = sample_traffic(load_policy(tiny_model_dir), INTERACTIONS, prefix="mlflow-full")
    produce(backend.producer(), cfg.kafka.topics, traffic)
    filling = FillBefore(FULL_BEFORE_STEP, database.fill)
    with pytest.raises(OSError) as failure:  # online-sao learn logs it (test_learner_disk_full.py) and prints it
        train(cfg, backend, init_distributed(), RunUntil(max_steps=INTERACTIONS), before_step=filling)
    assert (failure.value.errno, failure.value.filename) == (errno.ENOSPC, _db(cfg))
    assert filling.steps == FULL_BEFORE_STEP
    model = _client(cfg).get_registered_model(cfg.mlflow.registered_model)
    assert model.aliases == {"champion": 1, "candidate": 2}
    assert _registered(cfg) == {1: "1", 2: "2"}

    database.free()  # the operator made room; the supervisor restarts the learner
    second = train(cfg, backend, init_distributed(), RunUntil(idle_timeout_s=1.0))
    counts = Counter(iid for _, iid in read_ledger(cfg.checkpoint_dir))
    assert sorted(counts) == sorted(i.interaction_id for i in traffic) and set(counts.values()) == {1}
    assert second.steps == INTERACTIONS // PER_STEP - (FULL_BEFORE_STEP - 1)
    history = _client(cfg).get_metric_history(second.run_id, "reward_mean")
    assert sorted(m.step for m in history) == list(range(1, INTERACTIONS // PER_STEP + 1))
