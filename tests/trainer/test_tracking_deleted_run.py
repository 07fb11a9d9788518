"""The learner's MLflow run, or its experiment, deleted by an operator while the learner trains
(trainer/tracking.py, trainer/mlflow_store.py): metrics are a side channel, so training goes on, the
error is said once with how to restore the run, and the metrics kept meanwhile are logged once it is."""

from __future__ import annotations

import threading

from mlflow import MlflowClient

import trainer.tracking as tracking
from tests.fixtures.mlflow import tracker_config
from trainer.tracking import RunTracker


def _tracker(tmp_path, monkeypatch) -> tuple[RunTracker, MlflowClient]:
    monkeypatch.setattr(tracking, "TRACKING_RETRY_S", 0.0)  # every log step tries again
    cfg = tracker_config(tmp_path, **{"mlflow.log_every_steps": 1})
    tracker = RunTracker(cfg, stop=threading.Event())
    return tracker, MlflowClient(tracking_uri=cfg.mlflow_uri)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name == "trainer.tracking"]


def test_a_run_deleted_mid_training_keeps_its_metrics_until_restored(tmp_path, monkeypatch, caplog):
    """Before, the next log raised MLflow's "must be in the 'active' state" out of the learner's cycle."""
    tracker, client = _tracker(tmp_path, monkeypatch)
    tracker.log_step(1, {"loss": 1.0}, {})
    client.delete_run(tracker.run_id)
    with caplog.at_level("ERROR", logger="trainer.tracking"):
        tracker.log_step(2, {"loss": 0.5}, {})
        tracker.log_step(3, {"loss": 0.25}, {})
    assert tracker.unlogged_steps == 2
    assert _errors(caplog) == [f"the learner's MLflow run {tracker.run_id} was deleted: MLflow takes no metrics for it "
                               f"until it is restored (mlflow runs restore --run-id {tracker.run_id}); the learner "
                               f"goes on and keeps each step's metrics to send once it can"]  # once
    client.restore_run(tracker.run_id)
    tracker.log_step(4, {"loss": 0.125}, {})
    assert tracker.unlogged_steps == 0
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss")] == [
        (1, 1.0), (2, 0.5), (3, 0.25), (4, 0.125)]
    tracker.close()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_a_deleted_experiment_is_named_and_closing_on_it_does_not_raise(tmp_path, monkeypatch, caplog):
    tracker, client = _tracker(tmp_path, monkeypatch)
    tracker.log_step(1, {"loss": 1.0}, {})
    experiment = client.get_run(tracker.run_id).info.experiment_id
    client.delete_experiment(experiment)
    with caplog.at_level("WARNING", logger="trainer.tracking"):
        tracker.log_step(2, {"loss": 0.5}, {})
        tracker.close("FAILED")  # raised MLflow's error before, from the learner's finally
    assert f"was deleted with its experiment {experiment}: MLflow takes no metrics for it until the experiment is " \
           f"restored (mlflow experiments restore --experiment-id {experiment}" in _errors(caplog)[0]
    assert f"the run {tracker.run_id} stays open, 1 steps of metrics not logged" in caplog.text
    assert client.get_run(tracker.run_id).info.status == "RUNNING"


def test_ending_a_run_deleted_after_its_last_metrics_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    tracker, client = _tracker(tmp_path, monkeypatch)
    tracker.log_step(1, {"loss": 1.0}, {})
    client.delete_run(tracker.run_id)
    with caplog.at_level("ERROR", logger="trainer.tracking"):
        tracker.close()
    assert _errors(caplog) == [f"ending the MLflow run {tracker.run_id} failed: The run {tracker.run_id} must be in "
                               f"the 'active' state. Current state is deleted.; 0 steps of metrics not logged"]
