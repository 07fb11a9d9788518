"""Opening the learner's MLflow run when one answer of the store is lost (the server did the work, the
connection dropped before its answer came back): the tracker retries, and a retry must neither create
a second run nor count the restart twice."""

from __future__ import annotations

import threading

import pytest
import requests
from mlflow.exceptions import MlflowException

import trainer.tracking as tracking
from trainer.mlflow_store import open_client
from tests.fixtures.mlflow import tracker_config
from trainer.tracking import RunTracker


@pytest.fixture
def losing_one_answer(monkeypatch):
    """``lose(method)``: the tracker's client does ``method`` once and loses its answer (an MlflowException
    raised from a requests ConnectionError, as MLflow's REST client raises it), then answers as usual."""
    monkeypatch.setattr(tracking, "TRACKING_RETRY_S", 0.01)
    lost_calls: list[str] = []

    def lose(method: str) -> list[str]:
        def opening(uri):
            client = open_client(uri)
            real, pending = getattr(client, method), [True]

            def answer_lost(*args, **kwargs):
                result = real(*args, **kwargs)
                if pending and pending.pop():
                    lost_calls.append(method)
                    try:
                        raise requests.exceptions.ConnectionError("the server went away")
                    except requests.exceptions.ConnectionError:
                        raise MlflowException("connection refused") from None
                return result

            setattr(client, method, answer_lost)
            return client
        monkeypatch.setattr(tracking, "open_client", opening)
        return lost_calls
    return lose


def _runs(cfg):
    client = open_client(cfg.mlflow_uri)
    return client, client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])


@pytest.mark.parametrize("method", ["create_run", "log_batch", "log_text"])
def test_a_lost_answer_while_creating_the_run_makes_one_run(losing_one_answer, tmp_path, method):
    cfg = tracker_config(tmp_path)
    lost = losing_one_answer(method)
    tracker = RunTracker(cfg, stop=threading.Event())
    assert lost == [method]
    client, runs = _runs(cfg)
    assert [run.info.run_id for run in runs] == [tracker.run_id]
    run = client.get_run(tracker.run_id)
    assert run.data.tags["restarts"] == "0"
    assert run.data.params  # the configuration was logged
    assert [a.path for a in client.list_artifacts(tracker.run_id, "config")] == ["config/resolved.yaml"]
    tracker.close()


@pytest.mark.parametrize("method", ["set_tag", "update_run", "log_text"])
def test_a_lost_answer_while_reopening_the_run_counts_the_restart_once(losing_one_answer, tmp_path, method):
    cfg = tracker_config(tmp_path)
    first = RunTracker(cfg, stop=threading.Event())
    first.close()

    lost = losing_one_answer(method)
    resumed = RunTracker(cfg, run_id=first.run_id, stop=threading.Event())
    assert lost == [method]
    assert resumed.run_id == first.run_id
    assert resumed.resumed_tags["restarts"] == "0"
    client, runs = _runs(cfg)
    assert [run.info.run_id for run in runs] == [first.run_id]
    run = client.get_run(first.run_id)
    assert run.data.tags["restarts"] == "1"
    assert run.info.status == "RUNNING"
    assert sorted(a.path for a in client.list_artifacts(first.run_id, "config")) == [
        "config/resolved-restart-1.yaml", "config/resolved.yaml"]
    resumed.close()

    again = RunTracker(cfg, run_id=first.run_id, stop=threading.Event())  # the next restart counts on from there
    assert client.get_run(first.run_id).data.tags["restarts"] == "2"
    again.close()
