"""Run tags logged with the learner's metrics (which label each segment slot shows): set with their
window, sent only when they change, kept through an outage, and read back when the run reopens."""

from __future__ import annotations

import math

import pytest
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from tests.trainer.test_tracking import _client, _config, cfg, empty_store  # noqa: F401 (fixtures)
from trainer.step_window import StepWindow, Unsent
from trainer.tracking import RunTracker


def test_a_windows_tags_are_its_newest_values_sent_only_when_they_changed(tmp_path, empty_store):  # noqa: F811
    db = tmp_path / "mlflow.db"
    db.write_bytes(empty_store.read_bytes())
    tracker = RunTracker(_config(tmp_path / "data", db, **{"mlflow.log_every_steps": 2}))
    sent: list[dict[str, str]] = []
    log_batch = tracker.client.log_batch

    def spy(run_id, metrics=(), params=(), tags=(), **kwargs):
        if tags:
            sent.append({t.key: t.value for t in tags})
        return log_batch(run_id, metrics=metrics, params=params, tags=tags, **kwargs)

    tracker.client.log_batch = spy
    for step, label in [(1, "red"), (2, "blue"), (3, "blue"), (4, "blue"), (5, "green")]:
        tracker.log_step(step, averaged={"value_loss": 1.0}, latest={"segment.slot1.count": 1.0},
                         tags={"segment.slot1": label, "segment.slot2": ""})
    assert sent == [{"segment.slot1": "blue", "segment.slot2": ""}]  # step 2's window; step 4's changed nothing
    assert _client(tracker.cfg).get_run(tracker.run_id).data.tags["segment.slot1"] == "blue"
    tracker.close()  # step 5, the window left
    assert sent[1:] == [{"segment.slot1": "green"}]
    assert _client(tracker.cfg).get_run(tracker.run_id).data.tags["segment.slot1"] == "green"


def test_more_tags_than_one_mlflow_batch_takes_are_all_set(cfg):  # noqa: F811
    tracker = RunTracker(cfg)
    tags = {f"segment.slot{k}": f"user-{k}" for k in range(1, 151)}  # MLflow takes 100 per call
    tracker.log_metrics({"reward_mean": 0.5}, step=1, tags=tags)
    run_tags = _client(cfg).get_run(tracker.run_id).data.tags
    assert {k: v for k, v in run_tags.items() if k.startswith("segment.")} == tags


def test_a_reopened_run_hands_its_tags_back(cfg):  # noqa: F811
    first = RunTracker(cfg)
    first.log_metrics({}, step=3, tags={"segment.slot1.history": "3 red"})
    first.close()
    assert first.resumed_tags == {}  # a new run
    again = RunTracker(cfg, run_id=first.run_id)
    assert again.resumed_tags["segment.slot1.history"] == "3 red"


def test_the_window_gives_each_tags_newest_value_once():
    window = StepWindow()
    window.add(1, {}, {}, {"a": "x", "b": "y"})
    window.add(2, {}, {}, {"a": "z"})
    assert window.take().tags == {"a": "z", "b": "y"}
    window.add(3, {}, {}, {"a": "z", "b": "w"})
    assert window.take().tags == {"b": "w"}


def test_a_flag_reported_only_when_set_logs_the_share_of_the_windows_steps():
    """SAO reports critic_rewarm only on a re-warm step: one such step in four logged 1, not 0.25."""
    window = StepWindow()
    window.add(1, {"loss": 2.0, "drift_alarm": 0.0}, {})
    window.add(2, {"loss": 4.0, "drift_alarm": 1.0, "critic_rewarm": 1.0}, {})
    window.add(3, {"loss": math.nan, "drift_alarm": 0.0}, {})
    window.add(4, {"drift_alarm": 0.0, "skipped_nonfinite": 1.0, "nonfinite_inputs": 1.0}, {})
    assert window.take().metrics == {"loss": 3.0, "drift_alarm": 0.25, "critic_rewarm": 0.25,
                                     "skipped_nonfinite": 0.25, "nonfinite_inputs": 0.25}
    window.add(5, {"critic_rewarm": 1.0}, {})  # a new window counts its own steps
    assert window.take().metrics == {"critic_rewarm": 1.0}


def test_a_log_dropped_in_a_long_outage_hands_its_tags_to_the_next():
    unsent = Unsent(limit=2)
    for step, tags in [(1, {"a": "1", "b": "1"}), (2, {"a": "2"}), (3, {})]:
        unsent.add([Metric("m", 0.0, 0, step)], tags)
    assert unsent.dropped == 1 and len(unsent.logs) == 2
    assert [m.step for m in unsent.logs[0][0]] == [2] and unsent.logs[0][1] == {"a": "2", "b": "1"}


class _FailingOnce:
    """An MLflow client whose ``fail_at``-th log_batch call fails once (the server went away mid-log)."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at
        self.metrics: list[Metric] = []
        self.tags: list = []

    def log_batch(self, run_id, metrics=(), tags=()):
        self.calls += 1
        if self.calls == self.fail_at:
            raise MlflowException("the server went away")
        self.metrics += metrics
        self.tags += tags


def test_a_log_larger_than_one_batch_that_fails_part_way_sends_each_metric_once():
    """2500 metrics are three batches; the third fails: sent again, the first two must not be
    (MLflow keeps both copies of a metric logged twice at one step)."""
    unsent = Unsent(limit=10)
    unsent.add([Metric(f"m{i}", float(i), 0, 7) for i in range(2500)], {"a": "1"})
    client = _FailingOnce(fail_at=4)  # tags, then metrics 0-999, 1000-1999, 2000-2499
    with pytest.raises(MlflowException):
        unsent.send(client, "run")
    unsent.send(client, "run")
    assert sorted(m.key for m in client.metrics) == sorted(f"m{i}" for i in range(2500))
    assert [t.key for t in client.tags] == ["a"] and not unsent.logs
