"""The model directory a registry version copies, and the policy an alias points at (trainer/registry_versions.py)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch
from mlflow import MlflowClient

from online_sao.weights import FileWeightStore, WeightsRef
from tests.fixtures.mlflow import tracker_config
from trainer.registry_versions import CHAMPION, policy_of, stage_model_directory
from trainer.tracking import RunTracker


def test_a_version_of_a_sharded_base_model_holds_the_published_weights_and_no_shard_index(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "pytorch_model-00001-of-00002.bin"):
        (base / name).write_bytes(b"a shard of the base weights")
    index = '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}'
    (base / "model.safetensors.index.json").write_text(index)
    (base / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        (base / name).write_text(f"the base model's {name}")
    published = tmp_path / "v3.safetensors"
    published.write_bytes(b"the published weights of version 3")
    ref = WeightsRef(3, str(published), hashlib.sha256(published.read_bytes()).hexdigest())
    staged = tmp_path / "staged"
    staged.mkdir()

    stage_model_directory(ref, base, staged)

    assert sorted(p.name for p in staged.iterdir()) == ["chat_template.jinja", "config.json",
                                                         "generation_config.json", "model.safetensors",
                                                         "tokenizer.json"]
    assert (staged / "model.safetensors").read_bytes() == b"the published weights of version 3"
    assert (staged / "config.json").read_text() == "the base model's config.json"


def test_an_alias_on_a_version_without_the_learners_tags_counts_as_none_and_says_why(caplog):
    """Before, ``found.tags["policy_version"]`` raised a bare KeyError at every learner start."""
    tagged = {"policy_version": "3", "weights_location": "/w/v3.safetensors", "checksum": "ab"}
    expected = (3, WeightsRef(3, "/w/v3.safetensors", "ab"))
    assert policy_of(SimpleNamespace(version="4", tags=tagged), "candidate") == expected
    with caplog.at_level("ERROR", logger="trainer.registry_versions"):
        assert policy_of(SimpleNamespace(version="7", tags={"checksum": "ab"}), "champion") is None
        assert policy_of(SimpleNamespace(version="8", tags={**tagged, "policy_version": "v3"}), "candidate") is None
    first, second = caplog.messages
    assert first.startswith("registry: the champion alias is on registry version 7, which holds no policy a learner "
                            "registered (no tag policy_version, no tag weights_location): it counts as no champion "
                            "(the candidate is decided as without one")
    assert "registry version 8" in second and "policy_version 'v3' is not a number): it counts as no candidate." \
        in second


def test_a_champion_set_by_hand_on_a_foreign_version_lets_the_learner_start(tmp_path, caplog):
    """An operator registers a model directory of their own and gives it the champion alias: the
    learner's reads of the champion (its start pins the champion's weights) count it as none."""
    cfg = tracker_config(tmp_path)
    tracker = RunTracker(cfg)
    ref = FileWeightStore(str(tmp_path / "weights")).save(1, {"w": torch.ones(2)})
    tracker.registry.register(ref, 0.0)
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    source = client.get_run(tracker.run_id).info.artifact_uri + "/policy/v00000001"
    foreign = client.create_model_version(cfg.mlflow.registered_model, source, run_id=tracker.run_id)
    client.set_registered_model_alias(cfg.mlflow.registered_model, CHAMPION, foreign.version)
    with caplog.at_level("ERROR", logger="trainer.registry_versions"):
        assert tracker.registry.champion() is None
    assert tracker.registry.candidate() == (1, ref)
    assert f"the champion alias is on registry version {foreign.version}, which holds no policy" in caplog.text
    tracker.close()
