"""RunTracker against a real MLflow SQLite store in tmp_path."""

from __future__ import annotations

import math
import multiprocessing
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from online_sao.config import Config, load_config
from online_sao.weights import CorruptWeights, FileWeightStore, WeightsRef
from trainer.mlflow_store import experiment_id, open_client
from trainer.tracking import RunTracker, flatten_config


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """A migrated, empty MLflow SQLite database; creating one takes seconds, copying it does not."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def _config(data_dir: Path, db: Path, **overrides) -> Config:
    return load_config(environ={}, overrides={"paths.data_dir": str(data_dir),
                                              "mlflow.tracking_uri": f"sqlite:///{db}", **overrides})


@pytest.fixture
def cfg(tmp_path, empty_store) -> Config:
    """Config with its own copy of the empty store and a model directory holding a config file."""
    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    config = _config(tmp_path / "data", db)
    config.model_dir.mkdir(parents=True)
    (config.model_dir / "config.json").write_text('{"model_type": "fake"}')
    (config.model_dir / "model.safetensors").write_bytes(b"base weights: never copied into the registry")
    return config


@pytest.fixture
def store(tmp_path) -> FileWeightStore:
    return FileWeightStore(str(tmp_path / "weights"))


def _publish(store: FileWeightStore, version: int) -> WeightsRef:
    return store.save(version, {"w": torch.full((2, 2), float(version))})


def _client(cfg: Config) -> MlflowClient:
    return MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)


def test_new_run_holds_the_resolved_config(cfg):
    tracker = RunTracker(cfg)
    run = _client(cfg).get_run(tracker.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.params["algorithm.eps_low"] == "0.3"
    assert run.data.params["trainer.min_rollouts"] == "4"
    assert run.data.params["serving.feedback_secret"] == "**********"  # secrets never reach MLflow
    assert run.data.params == flatten_config(cfg)
    logged = yaml.safe_load(Path(download_artifacts(run_id=tracker.run_id, artifact_path="config/resolved.yaml",
                                                    tracking_uri=cfg.mlflow_uri)).read_text())
    assert logged == cfg.model_dump(mode="json")
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(cfg.data_dir)
    tracker.close()
    assert _client(cfg).get_run(tracker.run_id).info.status == "FINISHED"


def test_metrics_are_logged_per_step(cfg):
    tracker = RunTracker(cfg)
    tracker.log_metrics({"reward_mean": 0.25, "explained_variance": math.nan}, step=1)
    tracker.log_metrics({"reward_mean": 0.5}, step=2)
    history = _client(cfg).get_metric_history(tracker.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    (ev,) = _client(cfg).get_metric_history(tracker.run_id, "explained_variance")
    assert math.isnan(ev.value)


def test_a_cycles_metrics_are_logged_every_n_steps_as_the_windows_mean_and_newest(tmp_path, empty_store):
    """``mlflow.log_every_steps`` 3 over steps 1-7: logged at 3 and 6, and at 7 by ``close``; the
    step's figures as their mean over the window (NaN left out), the readings as the newest."""
    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    tracker = RunTracker(_config(tmp_path / "data", db, **{"mlflow.log_every_steps": 3}))
    for step in range(1, 8):
        loss = math.nan if step == 2 else float(step)
        tracker.log_step(step, averaged={"value_loss": loss, "only_nan": math.nan},
                         latest={"policy_version": step * 10})
    client = _client(tracker.cfg)
    assert [m.step for m in client.get_metric_history(tracker.run_id, "value_loss")] == [3, 6]
    tracker.close()
    history = {name: [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, name)]
               for name in ("value_loss", "policy_version")}
    assert history == {"value_loss": [(3, 2.0), (6, 5.0), (7, 7.0)],  # (1 + 3) / 2: step 2 gave NaN
                       "policy_version": [(3, 30.0), (6, 60.0), (7, 70.0)]}
    assert all(math.isnan(m.value) for m in client.get_metric_history(tracker.run_id, "only_nan"))


def test_restart_resumes_the_same_run(cfg):
    first = RunTracker(cfg)
    first.log_metrics({"reward_mean": 0.1}, step=1)
    first.close("KILLED")

    changed = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"policy_lr": 2e-5})})
    second = RunTracker(changed, run_id=first.run_id)
    second.log_metrics({"reward_mean": 0.2}, step=2)

    client = _client(cfg)
    assert second.run_id == first.run_id
    run = client.get_run(first.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags["restarts"] == "1"
    assert run.data.tags["config_changed.restart-1"] == "algorithm.policy_lr: 1e-05 -> 2e-05"
    assert run.data.params["algorithm.policy_lr"] == "1e-05"  # parameters keep the first lifetime's value
    assert [m.step for m in client.get_metric_history(first.run_id, "reward_mean")] == [1, 2]
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    assert len(client.search_runs([experiment.experiment_id])) == 1
    names = [a.path for a in client.list_artifacts(first.run_id, "config")]
    assert names == ["config/resolved-restart-1.yaml", "config/resolved.yaml"]


def test_a_run_the_store_no_longer_has_gives_a_new_run_named_after_it(cfg, caplog):
    """A checkpoint from before the tracking database was lost or replaced names a run that does
    not exist: the learner starts anyway, on a new run that says which one it lost."""
    lost = "0123456789abcdef0123456789abcdef"
    with caplog.at_level("WARNING", logger="trainer.tracking"):
        tracker = RunTracker(cfg, run_id=lost)
    tracker.log_metrics({"reward_mean": 0.3}, step=4)
    run = _client(cfg).get_run(tracker.run_id)
    assert tracker.run_id != lost
    assert run.data.tags["checkpoint_run_missing"] == lost and run.data.tags["restarts"] == "0"
    assert run.data.metrics == {"reward_mean": 0.3}
    assert f"MLflow run {lost} of the checkpoint does not exist" in caplog.text


def test_a_deleted_run_is_not_reopened(cfg, caplog):
    first = RunTracker(cfg)
    first.close("KILLED")
    client = _client(cfg)
    client.delete_run(first.run_id)
    with caplog.at_level("WARNING", logger="trainer.tracking"):
        second = RunTracker(cfg, run_id=first.run_id)
    second.log_metrics({"reward_mean": 0.3}, step=4)
    assert second.run_id != first.run_id
    assert client.get_run(second.run_id).data.tags["checkpoint_run_missing"] == first.run_id
    assert client.get_run(first.run_id).info.lifecycle_stage == "deleted"
    assert "was deleted" in caplog.text


def test_a_deleted_experiment_is_named_with_what_to_do_and_left_deleted(cfg):
    """MLflow keeps a deleted experiment's name, and refuses a run in it: every start raised
    "The experiment 1 must be in the 'active' state", with or without a checkpoint's run."""
    from online_sao.config import ConfigError

    first = RunTracker(cfg)
    first.close()
    client = _client(cfg)
    deleted = client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id
    client.delete_experiment(deleted)
    for run_id in (first.run_id, None):
        with pytest.raises(ConfigError, match=f"experiment '{cfg.mlflow.experiment}' \\(id {deleted}\\) is deleted"):
            RunTracker(cfg, run_id=run_id)
    assert client.get_experiment(deleted).lifecycle_stage == "deleted"
    assert client.get_run(first.run_id).info.lifecycle_stage == "deleted"


def test_registered_version_is_a_loadable_model_directory(tmp_path, empty_store, store, monkeypatch):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    cfg = _config(tmp_path / "data", db)
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    policy.save_pretrained(cfg.model_dir)
    with torch.no_grad():
        policy.model.norm.weight.add_(0.5)  # the published version differs from the base model
    ref = store.save(7, policy.state_dict())

    tracker = RunTracker(cfg)
    assert tracker.registry.register(ref, recent_reward=0.4) == "1"
    client = _client(cfg)
    version = client.get_model_version_by_alias(cfg.mlflow.registered_model, "candidate")
    assert str(version.version) == "1" and version.run_id == tracker.run_id
    assert version.tags["policy_version"] == "7" and version.tags["checksum"] == ref.checksum
    assert version.tags["weights_location"] == ref.location

    # models:/ URIs resolve against the process-wide registry URI (MLflow ignores the
    # registry_uri argument for them), as a user of the registry would set it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", cfg.mlflow_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", cfg.mlflow_uri)
    local = download_artifacts(f"models:/{cfg.mlflow.registered_model}@candidate", dst_path=str(tmp_path / "dl"))
    loaded = AutoModelForCausalLM.from_pretrained(local)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_register_refuses_weights_that_fail_their_checksum(cfg, store):
    ref = _publish(store, 1)
    tracker = RunTracker(cfg)
    with pytest.raises(CorruptWeights, match="checksum"):
        tracker.registry.register(WeightsRef(ref.version, ref.location, "0" * 64), recent_reward=0.0)
    assert _client(cfg).search_model_versions(f"name = '{cfg.mlflow.registered_model}'") == []


def test_decisions_move_the_aliases_and_carry_their_evidence(cfg, store):
    tracker = RunTracker(cfg)
    assert tracker.registry.champion() is None and tracker.registry.candidate() is None
    first = _publish(store, 1)
    assert tracker.registry.record_decision("promoted", {}, first) is False  # not registered: nothing written
    assert tracker.registry.champion() is None

    tracker.registry.register(first, recent_reward=0.0)
    assert tracker.registry.candidate() == (1, first)
    tracker.registry.record_decision("promoted", {"gate.decision": "no_champion"}, first)
    assert tracker.registry.champion() == (1, first)

    second = _publish(store, 2)
    second_registry_version = tracker.registry.register(second, recent_reward=0.0)
    evidence = {"gate.decision": "refused", "gate.reason": "ess=1.20 < min_ess=8.0"}
    tracker.registry.record_decision("pending", evidence, second)
    assert tracker.registry.champion() == (1, first) and tracker.registry.candidate() == (2, second)  # nothing moved

    third = _publish(store, 3)
    third_registry_version = tracker.registry.register(third, recent_reward=0.0)
    tracker.registry.record_decision("rolled_back", {"gate.decision": "rolled_back", "gate.difference": "-0.3"}, third)
    assert tracker.registry.champion() == (1, first) and tracker.registry.candidate() == (1, first)
    client = _client(cfg)
    name = cfg.mlflow.registered_model
    rejected = client.get_model_version(name, third_registry_version)
    assert rejected.tags["decision"] == "rolled_back" and rejected.tags["gate.difference"] == "-0.3"
    pending = client.get_model_version(name, second_registry_version)
    assert pending.tags["decision"] == "pending" and pending.tags["gate.reason"].startswith("ess=1.20")
    assert {v.tags["policy_version"] for v in client.search_model_versions(f"name = '{name}'")} == {"1", "2", "3"}


def test_champion_survives_a_restart(cfg, store):
    first = RunTracker(cfg)
    ref = _publish(store, 4)
    first.registry.register(ref, recent_reward=0.0)
    first.registry.record_decision("promoted", {}, ref)
    first.close()
    assert RunTracker(cfg, run_id=first.run_id).registry.champion() == (4, ref)


def _open_and_create_experiment(uri: str) -> None:
    client = open_client(uri)
    experiment_id(client, "racing")


def test_processes_opening_one_new_sqlite_store_at_once_all_succeed(tmp_path):
    """Without the lock, MLflow's migrations race: 9 of 12 such processes failed (3 x 4 on fresh stores)."""
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_open_and_create_experiment, args=(uri,)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    assert len(MlflowClient(tracking_uri=uri).search_experiments(filter_string="name = 'racing'")) == 1


def test_an_mlflow_server_that_does_not_answer_is_named_at_once(free_port):
    """MLflow's own client retries an unreachable server for minutes, deaf to SIGTERM."""
    from trainer.mlflow_store import TrackingUnavailable, open_client

    start = time.monotonic()
    with pytest.raises(TrackingUnavailable, match=rf"MLflow at http://127.0.0.1:{free_port} \(mlflow.tracking_uri\) "
                                                   "does not answer"):
        open_client(f"http://127.0.0.1:{free_port}")
    assert time.monotonic() - start < 10


def test_an_mlflow_server_that_answers_its_health_check_is_opened(free_port):
    import http.server
    import threading

    from trainer.mlflow_store import probe_server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", free_port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        probe_server(f"http://127.0.0.1:{free_port}/")
    finally:
        server.shutdown()


def _registered_dirs(cfg: Config) -> set[str]:
    """The model directories in the SQLite store's artifacts, by name (``v<policy version>``)."""
    return {d.name for d in (cfg.data_dir / "mlflow-artifacts").glob("*/artifacts/policy/v*") if d.is_dir()}


def _by_policy(cfg: Config) -> dict[int, dict[str, str]]:
    found = _client(cfg).search_model_versions(f"name = '{cfg.mlflow.registered_model}'")
    return {int(v.tags["policy_version"]): v.tags for v in found}


def test_registration_keeps_the_newest_model_directories_and_the_aliased_ones(tmp_path, empty_store, store,
                                                                              monkeypatch):
    """``mlflow.keep_registered_artifacts`` 2 over 12 registrations: the artifacts keep the newest
    two, the champion (an early version) and a version an operator gave an alias of its own; the
    other versions stay in the registry with their tags, marked ``weights_pruned=true``."""
    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    cfg = _config(tmp_path / "data", db, **{"mlflow.keep_registered_artifacts": 2})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    tracker = RunTracker(cfg)
    for version in range(1, 13):
        ref = _publish(store, version)
        tracker.registry.register(ref, recent_reward=0.0)
        if version == 3:
            tracker.registry.record_decision("promoted", {"gate.decision": "no_champion"}, ref)
        elif version > 3:
            tracker.registry.record_decision("pending", {"gate.decision": "refused"}, ref)
        assert len(_registered_dirs(cfg)) <= cfg.mlflow.keep_registered_artifacts + 2
    assert _registered_dirs(cfg) == {"v00000003", "v00000011", "v00000012"}  # champion, the newest two
    assert tracker.registry.champion()[0] == 3 and tracker.registry.candidate()[0] == 12
    tags = _by_policy(cfg)
    assert sorted(tags) == list(range(1, 13))  # every version and its decision stay
    assert [v for v, t in sorted(tags.items()) if t["weights_pruned"] == "true"] == [1, 2, *range(4, 11)]
    assert tags[5]["decision"] == "pending" and tags[5]["gate.decision"] == "refused"

    # registry version n holds policy version n here
    _client(cfg).set_registered_model_alias(cfg.mlflow.registered_model, "keep-by-hand", "11")
    for version in (13, 14, 15):
        tracker.registry.register(_publish(store, version), recent_reward=0.0)
    assert _registered_dirs(cfg) == {"v00000003", "v00000011", "v00000014", "v00000015"}
    # the champion's directory is still what the registry hands out (models:/ URIs resolve against
    # the process-wide registry URI)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", cfg.mlflow_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", cfg.mlflow_uri)
    local = download_artifacts(f"models:/{cfg.mlflow.registered_model}@champion", dst_path=str(tmp_path / "dl"))
    assert (Path(local) / "model.safetensors").is_file()


def test_versions_registered_before_retention_are_pruned_as_well(cfg, store):
    """A registry written by a learner without retention: its versions carry no ``weights_pruned``
    tag. The first learner that prunes marks them once and prunes them like its own."""
    tracker = RunTracker(cfg)
    for version in range(1, 5):
        tracker.registry.register(_publish(store, version), recent_reward=0.0)
    client, name = _client(cfg), cfg.mlflow.registered_model
    for found in client.search_model_versions(f"name = '{name}'"):
        client.delete_model_version_tag(name, found.version, "weights_pruned")
    client.delete_registered_model_tag(name, "weights_pruned_marked")
    assert len(_registered_dirs(cfg)) == 4

    later = RunTracker(cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(
        update={"keep_registered_artifacts": 1})}), run_id=tracker.run_id)
    later.registry.register(_publish(store, 5), recent_reward=0.0)
    assert _registered_dirs(cfg) == {"v00000005"}
    assert {v: t.get("weights_pruned") for v, t in _by_policy(cfg).items()} == {
        1: "true", 2: "true", 3: "true", 4: "true", 5: "false"}


def test_a_model_directory_a_stopped_registration_left_is_deleted_in_the_next_lifetime(cfg, store, tmp_path):
    """A learner stopped while the artifact store failed its upload leaves part of a model directory
    that no registry version refers to; the restarted learner's first registration deletes it."""
    tracker = RunTracker(cfg)
    tracker.registry.register(_publish(store, 1), recent_reward=0.0)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text('{"model_type": "fake"}')
    client = _client(cfg)
    client.log_artifacts(tracker.run_id, str(partial), "policy/v00000002")  # the weights never came
    client.log_artifacts(tracker.run_id, str(partial), "policy/notes")  # not a model directory
    assert _registered_dirs(cfg) == {"v00000001", "v00000002"}

    later = RunTracker(cfg, run_id=tracker.run_id)
    later.registry.register(_publish(store, 3), recent_reward=0.0)
    assert _registered_dirs(cfg) == {"v00000001", "v00000003"}
    assert [a.path for a in client.list_artifacts(tracker.run_id, "policy/notes")] == ["policy/notes/config.json"]
