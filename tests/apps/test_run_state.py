"""Removing a finished smoke/load run's own state, on the real broker and a real MLflow store."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from mlflow import MlflowClient

from apps.config import load_app_config
from apps.run_state import remove_run_state_of
from online_sao.weights import FileWeightStore
from streams.kafka_backend import KafkaBackend
from trainer.tracking import RunTracker

pytestmark = pytest.mark.kafka

GONE_WAIT_S = 20.0
"""How long a deleted topic may still be listed (Kafka deletes in the background)."""


@pytest.fixture
def run(tmp_path, kafka_broker):
    """A run's config on the session broker and a SQLite MLflow store, with its topics and consumer
    group on the cluster, two registered versions and the run directory's parts on disk."""
    run_id = f"smoke-{uuid.uuid4().hex[:8]}"
    kafka = kafka_broker.kafka_config()
    cfg = load_app_config(environ={}, overrides={
        "paths.data_dir": str(tmp_path / "data"), "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "kafka.bootstrap_servers": kafka.bootstrap_servers, "kafka.partitions": kafka.partitions,
        **{f"kafka.topics.{role}": f"{name}.{run_id}" for role, name in kafka.topics.model_dump().items()},
        "trainer.consumer_group": f"learner.{run_id}", "mlflow.experiment": f"online-sao.{run_id}",
        "mlflow.registered_model": f"online-sao-policy.{run_id}"})
    backend = KafkaBackend(cfg.kafka)
    backend.ensure_topics()
    learner = backend.consumer([cfg.kafka.topics.interactions], group_id=cfg.trainer.consumer_group)
    learner.poll(2.0)
    learner.close()  # the group stays, with its (empty) membership, as a stopped learner's does
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    store = FileWeightStore(str(tmp_path / run_id / "weights"))
    tracker = RunTracker(cfg)
    for version in (1, 2):
        tracker.registry.register(store.save(version, {"w": torch.full((2, 2), float(version))}), recent_reward=0.0)
    run_dir = tmp_path / run_id
    for part in ("checkpoints", "spool", "logs"):
        (run_dir / part).mkdir(parents=True)
        (run_dir / part / "file").write_text(part)
    return cfg, run_dir, tracker.run_id


def _topics_left(cfg) -> set[str]:
    names = {cfg.kafka.topics.interactions, cfg.kafka.topics.rewards, cfg.kafka.topics.weights,
             cfg.kafka.topics.dead_letters}
    deadline = time.monotonic() + GONE_WAIT_S
    while (left := names & set(KafkaBackend(cfg.kafka).list_topics())) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _groups(cfg) -> set[str]:
    with KafkaBackend(cfg.kafka).admin() as admin:
        return {group["group_id"] if isinstance(group, dict) else group[0] for group in admin.list_groups()}


def _model_dirs(cfg) -> set[str]:
    return {d.name for d in (cfg.data_dir / "mlflow-artifacts").glob("*/artifacts/policy/v*") if d.is_dir()}


def test_a_passed_runs_topics_group_registered_model_and_files_are_removed_and_its_record_kept(run):
    cfg, run_dir, mlflow_run = run
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    assert _model_dirs(cfg) == {"v00000001", "v00000002"} and cfg.trainer.consumer_group in _groups(cfg)
    lines = []

    assert remove_run_state_of(cfg, run_dir, lines.append) == []

    assert _topics_left(cfg) == set()
    assert cfg.trainer.consumer_group not in _groups(cfg)
    assert client.search_registered_models(f"name = '{cfg.mlflow.registered_model}'") == []
    assert _model_dirs(cfg) == set()
    assert client.get_run(mlflow_run).data.params  # the run's record stays
    assert sorted(p.name for p in run_dir.iterdir()) == ["logs"]
    assert lines[0].startswith("run state removed: topics ") and cfg.mlflow.experiment in lines[0]


def test_a_part_the_cluster_refuses_is_reported_and_the_other_parts_are_still_removed(run):
    """A consumer still in the group (a learner that did not stop) keeps the group; it is said, and the
    topics, registry and files go all the same."""
    cfg, run_dir, _ = run
    backend = KafkaBackend(cfg.kafka)
    member = backend.consumer([cfg.kafka.topics.rewards], group_id=cfg.trainer.consumer_group)
    try:
        member.poll(2.0)
        lines = []
        left = remove_run_state_of(cfg, run_dir, lines.append)
    finally:
        member.close()

    assert left == [f"consumer group left: {cfg.trainer.consumer_group} (NonEmptyGroupError)"]
    assert lines[-1] == f"warning: {left[0]}" and "but for 1 part(s)" in lines[0]
    assert _model_dirs(cfg) == set() and sorted(p.name for p in run_dir.iterdir()) == ["logs"]


def test_mlflow_not_answering_leaves_the_registry_and_removes_the_rest(run):
    """An MLflow server down at clean-up raised out of the run that had passed: smoke failed, and a
    load that had passed wrote no results."""
    cfg, run_dir, _ = run
    down = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"tracking_uri": "http://127.0.0.1:1"})})
    lines = []

    left = remove_run_state_of(down, run_dir, lines.append)

    assert len(left) == 1 and left[0].startswith("registered model left: TrackingUnavailable: MLflow at")
    assert _topics_left(cfg) == set() and sorted(p.name for p in run_dir.iterdir()) == ["logs"]


def test_the_deployments_own_state_is_refused(tmp_path):
    """Given the deployment's config (not the run's), the clean-up would delete production's topics,
    consumer group and registered model."""
    from apps.run_state import RunState

    deployment = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"not the state of run smoke-1234, not removed: sao.interactions, "):
        RunState.of(deployment, tmp_path / "smoke-1234")
