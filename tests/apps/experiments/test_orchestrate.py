"""Orchestration of one arm: a fresh start (earlier run's topics, groups and state deleted),
traffic gated on the learner's and judge's consumer groups holding partitions, thread budget."""

from __future__ import annotations

import json

import pytest

from apps.config import AppConfig, load_app_config
from apps.experiments import orchestrate
from apps.experiments.orchestrate import reset_arm, groups_ready, learner_threads, wait_for_consumers
from streams.kafka_backend import KafkaBackend


def _join(backend: KafkaBackend, cfg, group: str):
    """A consumer of the interactions and rewards topics that polls until it holds partitions."""
    consumer = backend.consumer([cfg.topics.interactions, cfg.topics.rewards], group_id=group, start="earliest")
    for _ in range(60):
        consumer.poll(timeout_s=0.5)
        if consumer.assignment():
            return consumer
    consumer.close()
    raise AssertionError(f"group {group} got no partitions")


@pytest.mark.kafka
def test_groups_ready_only_once_every_group_holds_partitions(kafka_config):
    backend = KafkaBackend(kafka_config)
    assert not groups_ready(backend, ["learner-g", "judge-g"])  # neither group exists yet
    learner = _join(backend, kafka_config, "learner-g")
    try:
        assert groups_ready(backend, ["learner-g"])
        assert not groups_ready(backend, ["learner-g", "judge-g"])
        judge = _join(backend, kafka_config, "judge-g")
        try:
            assert groups_ready(backend, ["learner-g", "judge-g"])
        finally:
            judge.close()
    finally:
        learner.close()


@pytest.mark.kafka
def test_wait_for_consumers_stops_when_a_component_dies(kafka_config):
    backend = KafkaBackend(kafka_config)

    def dead() -> None:
        raise RuntimeError("learner exited with 1")

    with pytest.raises(RuntimeError, match="learner exited"):
        wait_for_consumers(backend, ["nobody-here"], dead, timeout_s=30.0)


@pytest.mark.kafka
def test_reset_arm_deletes_the_earlier_runs_topics_groups_and_state(kafka_config, tmp_path):
    backend = KafkaBackend(kafka_config)
    cfg = load_app_config(environ={})
    cfg = cfg.model_copy(update={
        "kafka": kafka_config,
        "trainer": cfg.trainer.model_copy(update={"consumer_group": "old-learner"}),
        "experiment": cfg.experiment.model_copy(update={"judge_group": "old-judge"})})
    _join(backend, kafka_config, "old-learner").close()
    for name in orchestrate.ARM_STATE_DIRS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "left-over").write_text("x")
    lines: list[str] = []

    reset_arm(cfg, backend, tmp_path, lines.append)

    topics = kafka_config.topics
    assert not {topics.interactions, topics.rewards, topics.weights} & set(backend.list_topics())
    assert topics.dead_letters in backend.list_topics()  # shared by every arm: kept
    with backend.admin() as admin:
        assert "old-learner" not in {g["group_id"] for g in admin.list_groups()}
    assert not any((tmp_path / name).exists() for name in orchestrate.ARM_STATE_DIRS)
    assert len(lines) == 1 and "old-learner" in lines[0]
    backend.ensure_topics()  # the arm's topics can be created again, empty
    assert topics.interactions in backend.list_topics()


def test_learner_threads_leave_cores_to_serving_and_the_judge(monkeypatch):
    cfg = AppConfig()
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"torch_threads": 1})})
    monkeypatch.setattr(orchestrate.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert learner_threads(cfg) == 1
    monkeypatch.setattr(orchestrate.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert learner_threads(cfg) == 14
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"torch_threads": 8})})
    assert learner_threads(cfg) == 7


def test_learner_counters_come_from_the_arms_newest_learner_run(tmp_path):
    from apps.experiments.orchestrate import learner_counters
    from trainer.tracking import RunTracker

    def arm_cfg(group: str) -> AppConfig:
        cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
        return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"consumer_group": group})})

    assert learner_counters(arm_cfg("sao-learner.drift.grpo")) == {}  # no MLflow experiment yet
    for group, incomplete in (("sao-learner.drift.grpo", 1.0), ("sao-learner.drift.sao", 7.0),
                              ("sao-learner.drift.grpo", 3.0)):  # a rerun of the grpo arm: the newest counts
        tracker = RunTracker(arm_cfg(group))
        for step in (1, 2, 2):  # a learner restarted from its step-1 checkpoint logs step 2 again
            tracker.log_metrics({"join_incomplete_groups": incomplete, "step_time_s": 0.1}, step=step)
        tracker.close("FINISHED")
    counters = learner_counters(arm_cfg("sao-learner.drift.grpo"))
    assert counters["join_incomplete_groups"] == 3.0 and counters["steps"] == 2.0
    assert learner_counters(arm_cfg("sao-learner.drift.nobody")) == {}


def test_learner_counters_count_the_steps_the_learner_ran_not_the_steps_it_logged(tmp_path):
    """The learner logs every ``mlflow.log_every_steps``-th step and its last one as it stops: 12 steps
    at 10 log steps 10 and 12, which were counted as 2 steps (the agent's summary.json said 2)."""
    from apps.experiments.orchestrate import learner_counters
    from trainer.tracking import RunTracker

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "mlflow.log_every_steps": 10})
    tracker = RunTracker(cfg)
    for step in range(1, 13):
        tracker.log_step(step, averaged={"step_time_s": 0.1}, latest={"policy_version": float(step)})
    tracker.close("FINISHED")
    assert learner_counters(cfg)["steps"] == 12.0


def test_reset_registry_deletes_the_arms_registered_model_only(tmp_path):
    from mlflow import MlflowClient

    from apps.experiments.orchestrate import reset_registry
    from apps.experiments.scenario import arm_config

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    arm, other = (arm_config(cfg, a) for a in cfg.experiment.arms[:2])
    for acfg in (arm, other):
        client.create_registered_model(acfg.mlflow.registered_model)
    lines: list[str] = []
    reset_registry(arm, lines.append)
    reset_registry(arm, lines.append)  # nothing left: says nothing
    assert [m.name for m in client.search_registered_models()] == [other.mlflow.registered_model]
    assert lines == [f"deleted the earlier run's registered model {arm.mlflow.registered_model}"]


def test_an_arm_added_to_a_finished_run_is_reported_with_it_and_another_scenario_is_refused(tmp_path, tiny_model_dir):
    """The in-process driver, two seeds: a second run with one new arm leaves the first run's files as
    they were and reports all arms together; a run of another scenario into that directory stops
    before it writes anything."""
    from apps.experiments.orchestrate import run_simulation
    from apps.experiments.report import JSON_FILE
    from apps.experiments.results import ScenarioMismatch
    from tests.apps.experiments.test_inprocess import scenario
    from tests.fixtures.models import tiny_config

    out = tmp_path / "results"

    def config(arm: str, window: int, **fields):
        return tiny_config(tmp_path / "data", **{
            "model.path": str(tiny_model_dir), "experiment.results_dir": str(out), "experiment.seeds": 2,
            "experiment.driver": "inprocess", "serving.torch_threads": 1, "experiment.reference_arm": None,
            "experiment.arms": [{"name": arm, "algorithm": {"name": "running_mean", "running_mean_window": window}}],
            **scenario(**fields)})

    run_simulation(config("mean4", 4), progress=lambda _: None)
    first = {p: p.read_bytes() for p in out.glob("seed-*/mean4*")}
    assert len(first) == 4  # results and summary of each seed
    report = run_simulation(config("mean8", 8), progress=lambda _: None)
    assert {p: p.read_bytes() for p in out.glob("seed-*/mean4*")} == first
    assert sorted(arm["name"] for arm in json.loads((report.parent / JSON_FILE).read_text())) == ["mean4", "mean8"]
    for seed in ("seed-0", "seed-1"):
        assert [a["name"] for a in json.loads((out / seed / "scenario.json").read_text())["arms"]] == ["mean4", "mean8"]

    scenario_files = {p: p.read_bytes() for p in out.rglob("scenario.json")}
    with pytest.raises(ScenarioMismatch, match=r"\['mean4', 'mean8'\] from a scenario that differs in drop_rate"):
        run_simulation(config("mean16", 16, **{"experiment.drop_rate": 0.5}), progress=lambda _: None)
    assert {p: p.read_bytes() for p in out.rglob("scenario.json")} == scenario_files
    assert not list(out.rglob("mean16*"))
    # a one-seed run would leave the seed directories, which the report reads instead of its results
    with pytest.raises(ScenarioMismatch, match=r"holds the run\(s\) of seed-0, seed-1 from an earlier run"):
        run_simulation(config("mean8", 8, **{"experiment.seeds": 1}), progress=lambda _: None)
    assert {p: p.read_bytes() for p in out.rglob("scenario.json")} == scenario_files
    assert not (out / "mean8.jsonl").exists()


def test_a_resumed_sweep_runs_only_what_did_not_finish_and_ends_as_an_uninterrupted_one(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    """The in-process driver, two seeds, a running mean and sao (value pre-training): a sweep that dies in
    its last run, after writing part of that run's results, then resumed, leaves the files an
    uninterrupted sweep writes; the finished runs are not run again. Resuming with another setting
    stops before anything is written."""
    from apps.experiments import parallel
    from apps.experiments.orchestrate import run_simulation
    from apps.experiments.report import JSON_FILE
    from apps.experiments.results import decisions, read_arm
    from apps.experiments.resume import ResumeMismatch
    from tests.apps.experiments.test_inprocess import scenario
    from tests.fixtures.models import tiny_config

    def config(out, **fields):
        return tiny_config(tmp_path / "data", **{
            "model.path": str(tiny_model_dir), "experiment.results_dir": str(out), "experiment.seeds": 2,
            "experiment.driver": "inprocess", "serving.torch_threads": 1, "experiment.reference_arm": None,
            "experiment.arms": [{"name": "rm", "algorithm": {"name": "running_mean", "running_mean_window": 4}},
                                {"name": "sao"}],
            **scenario(**{"experiment.pretrain_rollouts": 6, **fields})})

    def outcomes(out) -> dict:
        return {(seed, arm): decisions(read_arm(out / seed / f"{arm}.jsonl"))
                for seed in ("seed-0", "seed-1") for arm in ("rm", "sao")}

    whole = tmp_path / "whole"
    run_simulation(config(whole), progress=lambda _: None)

    cut = tmp_path / "cut"
    real_run_arm, ran = parallel._run_arm, []

    def dies_in_the_last_run(run, name, *args):
        summary = real_run_arm(run, name, *args)
        ran.append((run.experiment.results_dir.name, name))
        if len(ran) == 4:  # killed before it ended: half its results written, no summary
            results = run.experiment.results_dir / f"{name}.jsonl"
            lines = results.read_text().splitlines(keepends=True)
            results.write_text("".join(lines[:len(lines) // 2]))
            raise RuntimeError("killed")
        return summary

    monkeypatch.setattr(parallel, "_run_arm", dies_in_the_last_run)
    with pytest.raises(RuntimeError, match="killed"):
        run_simulation(config(cut), progress=lambda _: None)
    assert ran[-1] == ("seed-1", "sao")
    kept = {p: p.read_bytes() for p in cut.glob("seed-*/*") if p.is_file()}

    ran.clear()
    lines = []
    report = run_simulation(config(cut, **{"experiment.resume": True}), progress=lines.append)
    assert ran == [("seed-1", "sao")]
    assert "resume: 3 of 4 runs finished earlier with these settings and are kept; seed-0: rm, sao; seed-1: rm" in lines
    assert outcomes(cut) == outcomes(whole)
    # the kept runs' files are as they were (scenario.json now says the run resumed)
    rerun = {cut / "seed-1" / "sao.jsonl", cut / "seed-1" / "sao.summary.json"}
    assert len(kept) == 9 and rerun - set(kept) == {cut / "seed-1" / "sao.summary.json"}
    for path, content in kept.items():
        if path.name != "scenario.json" and path not in rerun:
            assert path.read_bytes() == content, path
    assert sorted(arm["name"] for arm in json.loads((report.parent / JSON_FILE).read_text())) == ["rm", "sao"]

    files = {p: p.read_bytes() for p in cut.rglob("*") if p.is_file() and "report" not in p.parts}
    with pytest.raises(ResumeMismatch, match=r"arm 'rm' finished with other settings than this run's: "
                                             r"trainer.min_rollouts: 2 -> 3\."):
        run_simulation(config(cut, **{"experiment.resume": True, "trainer.min_rollouts": 3}), progress=lambda _: None)
    assert {p: p.read_bytes() for p in cut.rglob("*") if p.is_file() and "report" not in p.parts} == files


def test_a_live_summary_takes_the_learners_counters_and_leaves_out_what_it_did_not_log(tmp_path):
    from apps.experiments.orchestrate import live_summary

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    grpo = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"name": "grpo"})})
    learner = {"steps": 40.0, "rollbacks": 1.0, "drift_restarts": 2.0, "drift_rollbacks": 1.0,
               "join_complete_groups": 6.0, "join_incomplete_groups": 2.0, "join_group_wait_s": 12.0}
    summary = live_summary(grpo, "grpo_dis_g4", 600, 3, 137.74, 124.46, learner)
    assert (summary.answered, summary.failed, summary.wall_s, summary.traffic_s) == (600, 3, 137.7, 124.5)
    assert (summary.learner_steps, summary.rollbacks, summary.drift_restarts, summary.drift_rollbacks) == (40, 1, 2, 1)
    assert (summary.complete_groups, summary.incomplete_groups, summary.group_wait_s) == (6, 2, 1.5)  # 12 s / 8 groups
    sao = live_summary(cfg, "sao", 600, 0, 1.0, 1.0, {"steps": 40.0})  # an older learner's run: no drift counters
    assert (sao.drift_restarts, sao.drift_rollbacks, sao.rollbacks, sao.complete_groups) == (None, None, None, None)


def test_the_simulations_report_is_logged_to_the_configured_mlflow_experiment(tmp_path, monkeypatch):
    """``simulate`` (and ``lr-sweep``, through it) logged its report to the experiment "online-sao"
    whatever ``mlflow.experiment`` said, while ``online-sao report`` logged to the configured one."""
    from apps.default_model import builder
    from apps.experiments import parallel, report, style
    from apps.experiments.results import RewardRow, append_row
    from apps.experiments.scenario import results_dir

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "experiment.driver": "inprocess",
                                                 "mlflow.experiment": "my-drift-exp"})
    scenario = cfg.experiment

    def run_arms(plan, *args, **kwargs):  # the arms' results, without running them
        for run, todo in plan:
            for name in todo:
                for i in range(scenario.rollouts_per_arm):
                    append_row(results_dir(run) / f"{name}.jsonl",
                               RewardRow(rollout=i, t=1000.0 + i, version=0, reward=0.5, quality=1.0, style=0.5,
                                         preferred=scenario.preferred_style(i)))

    logged = []
    monkeypatch.setattr(parallel, "run_arms_inprocess", run_arms)
    monkeypatch.setattr(builder, "build_base_model", lambda *args, **kwargs: tmp_path / "model")
    monkeypatch.setattr(style, "load_or_train", lambda *args, **kwargs: None)
    monkeypatch.setattr(report, "log_to_mlflow", lambda out_dir, arms, uri, experiment, run_name, artifacts, **_:
                        logged.append((uri, experiment, artifacts)))
    orchestrate.run_simulation(cfg, arms=["sao"], progress=lambda line: None)
    assert logged == [(cfg.mlflow_uri, "my-drift-exp", (cfg.data_dir / "mlflow-artifacts").as_uri())]
