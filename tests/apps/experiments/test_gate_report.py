"""The registry's decisions in the report, read from a real MLflow SQLite store that the
learner's own Releases filled (real weight store, scripted scorer as in tests/trainer/test_deploy.py)."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch
from matplotlib.image import imread
from mlflow import MlflowClient

from apps.config import load_app_config
from apps.experiments.gate_report import GATE_PNG
from apps.experiments.report import write_report
from online_sao.config import dump_config
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from tests.apps.experiments.test_report import section, synthetic_rewards, write_run
from tests.trainer.test_deploy import STYLE_A, ScriptedScorer, _rollout, _stale_champion_scenario
from tests.trainer.test_tracking import empty_store  # noqa: F401  (the module-scoped template store)
from trainer.deploy import OffPolicyGate, RecentWindow
from trainer.publisher import Publisher
from trainer.releases import Releases
from trainer.tracking import RunTracker

REGISTER_EVERY = 2
LONG_FROM_VERSION = 6
"""Versions from here on answer with 10 tokens, over the length monitor's 5: candidate v6 trips it."""


def _fill_registry(cfg, last_version: int = 8) -> None:
    """Versions 1-8 (to ``last_version``) released as the learner does: candidates v2 and v4 pass (same
    answers as the champion, no monitor over), v6's long answers trip the length monitor at v8's
    release. The judge's quality of version v's answers is v / 8."""
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    publisher = Publisher(FileWeightStore(cfg.weight_store_url), backend.producer(), cfg.kafka.topics.weights, "m",
                          keep_versions=2)
    window = RecentWindow(cfg.deploy.window)
    releases = Releases(publisher, RunTracker(cfg), OffPolicyGate(ScriptedScorer(dict.fromkeys(range(1, 9), STYLE_A)),
                                                                  cfg.deploy), window, cfg.deploy, REGISTER_EVERY)
    for version in range(1, last_version + 1):
        releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        answer = [5] * (8 if version >= LONG_FROM_VERSION else 0) + [5, STYLE_A]
        window.observe([replace(_rollout(f"v{version}-{i}", answer, version, 1.0, logprob=math.log(0.9) / len(answer)),
                                scores={"quality": version / 8}) for i in range(40)])


def _learner_cfg(data_dir, db, group: str):
    cfg = load_app_config(environ={}, overrides={
        "paths.data_dir": str(data_dir), "mlflow.tracking_uri": f"sqlite:///{db}",
        "mlflow.register_every": REGISTER_EVERY, "trainer.consumer_group": group,
        "deploy.window": 80, "deploy.monitor_max_mean_length": 5})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    return cfg


def _live_sao_arm(tmp_path, store):
    """A run directory (synthetic rewards) whose arm sao has a live learner's config, on a copy of
    the template MLflow store; returns (run directory, that config)."""
    results = tmp_path / "results"
    write_run(results, {"sao": synthetic_rewards(3, 0)})
    db = tmp_path / "mlflow.db"
    shutil.copy(store, db)
    cfg = _learner_cfg(tmp_path / "data", db, "learner.synthetic.sao")
    (results / "arms" / "sao").mkdir(parents=True)
    (results / "arms" / "sao" / "config.yaml").write_text(dump_config(cfg))
    return results, cfg


def _sao_rows(results, report_dir) -> list[list[str]]:
    """The cells of each row of arm sao's registry table in the report written now."""
    text = section(write_report(results, report_dir).read_text(), "Registry decisions (promotion gate and monitors)")
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.split("### sao", 1)[1].splitlines()
            if line.startswith("| ") and not line.startswith("| registry")]


def test_report_shows_each_decision_of_the_arms_learner_from_mlflow(tmp_path, empty_store):  # noqa: F811
    results = tmp_path / "results"
    write_run(results, {"sao": synthetic_rewards(3, 0), "running_mean_w8": synthetic_rewards(12, 1)})
    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    cfg = _learner_cfg(tmp_path / "data", db, "learner.synthetic.sao")
    (results / "arms" / "sao").mkdir(parents=True)
    (results / "arms" / "sao" / "config.yaml").write_text(dump_config(cfg))
    _fill_registry(cfg)

    report = write_report(results, tmp_path / "report").read_text()

    text = section(report, "Registry decisions (promotion gate and monitors)")
    assert "### running_mean_w8" not in text  # no live learner config: no registry to read
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.split("### sao", 1)[1].splitlines()
            if line.startswith("| ") and not line.startswith("| registry")]
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    tags = {str(v.version): v.tags for v in client.search_model_versions(f"name = '{cfg.mlflow.registered_model}'")}
    # candidate, decided at the next registration, its first rollout (rows of version v start at 4v),
    # seconds from the first (t = 1000 + rollout), decision, the gate's verdict
    assert [r[1:7] for r in rows] == [["v2", "v4", "16", "16", "promoted", "no_champion"],
                                      ["v4", "v6", "24", "24", "promoted", "promoted"],
                                      ["v6", "v8", "32", "32", "rolled back", "promoted"]]
    assert rows[0][7] == "-" and rows[0][-1] == "none"
    assert float(rows[1][7]) == round(float(tags[rows[1][0]]["gate.candidate_value"]), 3)
    assert rows[2][-1] == "mean_length" and tags[rows[2][0]]["decision"] == "rolled_back"
    assert float(rows[1][8]) == round(float(tags[rows[1][0]]["gate.champion_value"]), 3)
    assert rows[1][9] == f"[{float(tags[rows[1][0]]['gate.low']):.3f}, {float(tags[rows[1][0]]['gate.high']):.3f}]"
    assert float(rows[1][10]) == round(float(tags[rows[1][0]]["gate.candidate_ess"]), 1)
    assert rows[0][12] == "-" and rows[1][12] == "0"  # no gate for the first; no canary: 0 champion answers
    # quality on the answers of the candidate and its successor (40 each): v2 -> (2/8 + 3/8) / 2
    assert [r[13] for r in rows] == ["0.312", "0.562", "0.812"]
    assert f"![registry decisions over the run]({GATE_PNG})" in report
    assert imread(tmp_path / "report" / GATE_PNG).shape[0] > 100


def test_report_without_live_arms_has_no_registry_section(tmp_path):
    results = tmp_path / "results"
    write_run(results, {"sao": synthetic_rewards(3, 0)})
    report = write_report(results, tmp_path / "report").read_text()
    assert "Registry decisions" not in report
    assert not (tmp_path / "report" / GATE_PNG).exists()


@pytest.mark.parametrize(("rollback", "decision"), [(0.0, "drift_restart"), (1.0, "drift_rollback")])
def test_a_drift_restart_is_shown_decided_when_it_was_published(tmp_path, empty_store, rollback,  # noqa: F811
                                                                decision):
    results, cfg = _live_sao_arm(tmp_path, empty_store)
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    publisher = Publisher(FileWeightStore(cfg.weight_store_url), backend.producer(), cfg.kafka.topics.weights, "m",
                          keep_versions=2)
    releases = Releases(publisher, RunTracker(cfg), OffPolicyGate(ScriptedScorer(dict.fromkeys(range(1, 5), STYLE_A)),
                                                                  cfg.deploy), RecentWindow(80), cfg.deploy,
                        REGISTER_EVERY)
    for version in range(1, 5):  # v2 registered, then superseded by the restart v3 before any decision
        releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0),
                         {"drift_alarm": 1.0, "drift_drop": 0.5, "drift_z": 4.0, "drift_rollback": rollback}
                         if version == 3 else None)

    rows = _sao_rows(results, tmp_path / "report")
    # decided at its own release: the first rollout of v3 is 4 * 3
    assert [r[1:7] for r in rows] == [["v3", "v3", "12", "12", "promoted", decision]]


def test_a_decision_on_the_champions_record_says_so(tmp_path, empty_store):  # noqa: F811
    """The stale-champion scenario of tests/trainer/test_deploy.py: v6 is decided against v4's record."""
    results, cfg = _live_sao_arm(tmp_path, empty_store)
    _stale_champion_scenario(cfg)

    rows = _sao_rows(results, tmp_path / "report")
    gates = {r[1]: (r[5], r[6]) for r in rows}
    assert gates["v6"] == ("promoted", "promoted on record") and gates["v4"] == ("promoted", "promoted")


def test_a_multi_seed_report_reads_the_first_seeds_own_learner_and_registry(tmp_path, empty_store):  # noqa: F811
    """Every seed's run of an arm had one consumer group and one registered model: each run deleted
    the model first (as run_arm does), and the report of seed 0 read the newest learner run of the
    group, the last seed's, whose decisions it showed against seed 0's rewards."""
    from apps.experiments.orchestrate import learner_run, reset_registry, seed_runs
    from apps.experiments.scenario import arm_config, results_dir

    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    results = tmp_path / "results"
    cfg = load_app_config(environ={}, overrides={
        "paths.data_dir": str(tmp_path / "data"), "mlflow.tracking_uri": f"sqlite:///{db}",
        "mlflow.register_every": REGISTER_EVERY, "deploy.window": 80, "deploy.monitor_max_mean_length": 5,
        "experiment.seeds": 2, "experiment.results_dir": str(results)})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    arms = []
    for k, run in enumerate(seed_runs(cfg)):  # one after the other, as the live driver runs them
        acfg = arm_config(run, next(a for a in run.experiment.arms if a.name == "sao"))
        write_run(results_dir(run), {"sao": synthetic_rewards(3, k)}, seed=k)
        (results_dir(run) / "arms" / "sao").mkdir(parents=True)
        (results_dir(run) / "arms" / "sao" / "config.yaml").write_text(dump_config(acfg))
        reset_registry(acfg, lambda line: None)
        _fill_registry(acfg, last_version=8 if k == 0 else 4)  # seed 1 decides one candidate only
        arms.append(acfg)

    assert [learner_run(a).data.params["trainer.seed"] for a in arms] == ["0", "1"]
    assert [a.mlflow.registered_model for a in arms] == [f"{cfg.mlflow.registered_model}.seed-{k}.drift.sao"
                                                         for k in (0, 1)]
    assert arms[0].trainer.consumer_group == arm_config(cfg, cfg.experiment.arms[0]).trainer.consumer_group
    assert arm_config(cfg, cfg.experiment.arms[0]).mlflow.registered_model == \
        f"{cfg.mlflow.registered_model}.drift.sao"  # a single seed's names are as they were
    assert "(seed directory seed-0)" in write_report(results, tmp_path / "report").read_text()
    rows = _sao_rows(results, tmp_path / "report")
    assert [r[1:6] for r in rows] == [["v2", "v4", "16", "16", "promoted"], ["v4", "v6", "24", "24", "promoted"],
                                      ["v6", "v8", "32", "32", "rolled back"]]
