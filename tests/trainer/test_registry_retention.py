"""Registry retention's sweep of a run's unregistered model directories, against a real MLflow SQLite
store: a directory a version of another registered model refers to is not unregistered."""

from __future__ import annotations

from pathlib import Path

import torch
from mlflow import MlflowClient

from online_sao.weights import FileWeightStore
from tests.fixtures.mlflow import tracker_config
from trainer.tracking import RunTracker


def test_a_run_resumed_under_another_registered_model_keeps_the_first_models_directories(tmp_path):
    cfg = tracker_config(tmp_path)
    store = FileWeightStore(str(tmp_path / "weights"))
    first = RunTracker(cfg)
    for version in (1, 2):
        ref = store.save(version, {"w": torch.full((2,), float(version))})
        first.registry.register(ref, 0.0)
        if version == 1:
            first.registry.record_decision("promoted", {}, ref)
    first.close()
    renamed = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"registered_model": "policy-renamed"})})
    resumed = RunTracker(renamed, run_id=first.run_id)  # a new lifetime: its first pruning sweeps the run
    resumed.registry.register(store.save(3, {"w": torch.full((2,), 3.0)}), 0.0)
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    champion = client.get_model_version_by_alias(cfg.mlflow.registered_model, "champion")
    assert Path(champion.source.removeprefix("file://")).is_dir()
    assert champion.tags["weights_pruned"] == "false"
    resumed.close()
