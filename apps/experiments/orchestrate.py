"""``online-sao simulate``: run every arm of a scenario, for every seed, then write the report.

``experiment.driver`` chooses how an arm runs: ``live`` (below, the reference) or
``inprocess`` (experiments/inprocess.py: the same parts in one process, in rollout
time; ``experiment.jobs`` runs its (seed, arm) pairs side by side, experiments/parallel.py).
``experiment.seeds`` > 1 repeats the scenario with shifted seeds, one results directory per
seed (``seed-<k>/``); the report aggregates them.

The live driver:

For each arm, one after the other with the same seeds and traffic: the arm's
resolved configuration (own topics, consumer groups, weights, checkpoints) is
written to ``<results>/arms/<arm>/config.yaml``; serving, the learner and the
judge start as their own ``online-sao`` processes on it; simulated users chat
over HTTP until the arm's rollouts are answered; then the arm is torn down and
the next one starts. The report is written at the end.

Every arm starts from nothing: its topics, consumer groups, weights, checkpoints
and spool from an earlier run of the same scenario are deleted first (otherwise
the learner would resume from the earlier run's checkpoint).

Traffic starts only when the learner and the judge are ready: their Kafka
consumer groups are Stable and every member holds partitions. The learner spends
10-20 s loading the model and opening MLflow, and its first group join can come
back with no partitions (no topic metadata yet) and take another rebalance;
traffic sent before that is trained on late, in a few large steps, so the first
preference phase would be answered almost entirely by the starting policy.
Traffic itself is not paced by the learner: requests arrive at the scenario's
fixed seeded rate (experiment.requests_per_second), so every arm sees the same
prompts at the same times and a slower learner shows up as policy lag, as in
the asynchronous setting of the paper; the rate is chosen so that the SAO
learner keeps up on a small CPU machine (docs/EXPERIMENTS.md).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from apps.config import AppConfig
from apps.config_checks import (check_arms_fit_the_algorithm, check_pretraining_reads_every_rollout,
                                check_raters_fit_the_reward_range)
from apps.experiments.results import (ArmSummary, count_reward_rows, merged_scenario, refuse_other_seeds,
                                      replace_scenario, summary_path, write_summary)
from apps.experiments.resume import finished_arms, outcome_settings
from apps.experiments.scenario import arm_config, results_dir
from apps.stack import Stack, free_port, threads_env, write_private
from online_sao.config import ConfigError, dump_config

if TYPE_CHECKING:
    from streams.kafka_backend import KafkaBackend

READY_TIMEOUT_S = 300.0
"""Serving loads the model and connects to the broker before /readyz answers."""
CONSUMERS_READY_TIMEOUT_S = 180.0
"""The learner loads the model and opens MLflow, then joins its group; the judge trains or loads
its classifier. Both must hold partitions before traffic starts."""
GROUP_POLL_S = 1.0
"""Pause between two looks at the consumer groups (each is a broker round trip)."""
TOPIC_DELETE_TIMEOUT_S = 60.0
"""How long deleted topics of an earlier run may take to disappear before they are recreated."""
REWARD_DRAIN_S = 60.0
"""After the last answer, how long to wait for the judge to score the arm's remaining rollouts."""


def run_arm(cfg: AppConfig, arm_name: str, progress: Callable[[str], None] = print,
            pretrain_file: Path | None = None) -> ArmSummary:
    """Run one arm end to end on the already running broker; writes and returns its summary. An
    arm with a critic pre-trains it on ``pretrain_file`` (apps/experiments/pretrain_data.py) when given."""
    from apps.experiments.simulate import drive_arm
    from apps.experiments.style import load_or_train
    from streams.kafka_backend import KafkaBackend

    arm = next(a for a in cfg.experiment.arms if a.name == arm_name)
    port = free_port()
    acfg = arm_config(cfg, arm)
    acfg = acfg.model_copy(update={"serving": acfg.serving.model_copy(update={"port": port})})
    learn = ["learn"]
    if pretrain_file is not None and needs_critic(acfg):
        acfg = acfg.model_copy(update={"trainer": acfg.trainer.model_copy(update={"pretrain_file": pretrain_file})})
        learn.append("--pretrain-critic")
    out = results_dir(cfg)
    summary_path(out, arm.name).unlink(missing_ok=True)  # first: only a finished run has one
    arm_dir = out / "arms" / arm.name
    config_path = arm_dir / "config.yaml"
    write_private(config_path, dump_config(acfg, reveal_secrets=True))
    backend = KafkaBackend(acfg.kafka)
    reset_arm(acfg, backend, arm_dir, progress)
    reset_registry(acfg, progress)
    backend.ensure_topics()
    results_path = out / f"{arm.name}.jsonl"
    results_path.unlink(missing_ok=True)

    started = time.monotonic()
    with Stack(config_path, {}, arm_dir, progress=progress, resolved=True) as stack:
        # the three start together: none needs another to start (each talks to the broker only),
        # and each spends its first seconds importing torch and loading the model
        server = stack.start("serving", ["serve"])
        stack.start("learner", learn, env=threads_env(learner_threads(acfg)))
        stack.start("judge", ["judge", "--arm", arm.name], env=threads_env(1))
        base_url = f"http://127.0.0.1:{port}"
        stack.wait_http(server, f"{base_url}/readyz", READY_TIMEOUT_S)
        classifier = load_or_train(acfg, progress)
        waited = wait_for_consumers(backend, [acfg.trainer.consumer_group, acfg.experiment.judge_group],
                                    stack.check_alive, CONSUMERS_READY_TIMEOUT_S)
        progress(f"learner and judge hold their partitions after {waited:.1f} s; traffic starts")
        stats = asyncio.run(drive_arm(acfg, f"{base_url}/v1", None, classifier, results_path, progress=progress,
                                    check_alive=stack.check_alive))
        _wait_for_rewards(stack, results_path, stats.answered, progress)
    learner = learner_counters(acfg)  # the learner has stopped: its last metrics are in MLflow
    summary = live_summary(acfg, arm.name, stats.answered, stats.failed, time.monotonic() - started, stats.wall_s,
                           learner)
    write_summary(out, summary)
    progress(f"arm {arm.name}: {stats.answered} answered, {stats.failed} failed in {summary.wall_s} s")
    return summary


def needs_critic(acfg: AppConfig) -> bool:
    """Whether the arm's learning rule trains a critic (and so gets value pre-training)."""
    from online_sao.algorithms import algorithm_class

    return algorithm_class(acfg.algorithm.name).needs_critic


def learner_run(acfg: AppConfig):
    """The arm's newest learner run in MLflow (an ``mlflow.entities.Run``), found by its consumer
    group, which names the arm, and its registered model, which names the seed's run of it as well
    (:func:`seed_config`); None when there is none."""
    from trainer.mlflow_store import open_client

    client = open_client(acfg.mlflow_uri)
    experiment = client.get_experiment_by_name(acfg.mlflow.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"params.`trainer.consumer_group` = '{acfg.trainer.consumer_group}' AND "
                                            f"params.`mlflow.registered_model` = '{acfg.mlflow.registered_model}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def live_summary(acfg: AppConfig, name: str, answered: int, failed: int, wall_s: float, traffic_s: float,
                 learner: dict[str, float]) -> ArmSummary:
    """A live arm's summary: the traffic's counts and times, and the learner's counters as it left them
    in MLflow (:func:`learner_counters`; a counter it did not log is None)."""
    def count(key: str) -> int | None:
        return int(learner[key]) if key in learner else None

    grouped = acfg.algorithm.name == "grpo"
    groups = learner.get("join_complete_groups", 0.0) + learner.get("join_incomplete_groups", 0.0)
    return ArmSummary(
        name=name, driver="live", answered=answered, failed=failed, wall_s=round(wall_s, 1),
        traffic_s=round(traffic_s, 1), learner_steps=count("steps"),
        complete_groups=count("join_complete_groups") if grouped else None,
        incomplete_groups=count("join_incomplete_groups") if grouped else None,
        group_wait_s=learner["join_group_wait_s"] / groups if grouped and groups else None,
        rollbacks=count("rollbacks"), drift_restarts=count("drift_restarts"), drift_rollbacks=count("drift_rollbacks"),
        settings=outcome_settings(acfg))


def learner_counters(acfg: AppConfig) -> dict[str, float]:
    """The last value of every metric of the arm's newest learner run in MLflow
    (:func:`learner_run`), plus ``steps``: the newest step it logged ``step_time_s`` at (0: none);
    empty when there is no such run.

    The learner logs every ``mlflow.log_every_steps``-th step and, as it stops, its last one (trainer/
    tracking.py: ``RunTracker.close``), so the newest logged step is the steps it ran whatever that
    setting is; counting the logged steps gave 2 for 12 learner steps at the default of 10. Steps
    number on across a restart from a checkpoint (in the same run), and one replayed is the same step.
    A learner killed outright never logs its last window: up to ``log_every_steps - 1`` steps go
    uncounted then."""
    from mlflow import MlflowClient

    run = learner_run(acfg)
    if run is None:
        return {}
    history = MlflowClient(tracking_uri=acfg.mlflow_uri).get_metric_history(run.info.run_id, "step_time_s")
    steps = max((m.step for m in history), default=0)
    return {**run.data.metrics, "steps": float(steps)}


def learner_threads(acfg: AppConfig) -> int:
    """CPU threads the learner may use: the cores left after serving's and one for the judge and
    the simulated users. Without a bound torch starts a thread per core in every process, and on a
    small machine the oversubscribed threads spin against each other: beside serving and the judge
    on 2 cores a learner step took 7 s (p50) uncapped and 0.15-0.3 s capped (docs/EXPERIMENTS.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - (acfg.serving.torch_threads or 1) - 1)


ARM_STATE_DIRS = ("weights", "checkpoints", "spool", "logs")
"""Directories under an arm's results directory that an earlier run of the arm leaves behind."""


def reset_arm(acfg: AppConfig, backend: KafkaBackend, arm_dir: Path, progress: Callable[[str], None]) -> None:
    """Delete what an earlier run of this arm left: its state directories, topics and consumer groups."""
    import shutil

    for name in ARM_STATE_DIRS:
        shutil.rmtree(arm_dir / name, ignore_errors=True)
    topics = acfg.kafka.topics
    arm_topics = {topics.interactions, topics.rewards, topics.weights}
    groups = {acfg.trainer.consumer_group, acfg.experiment.judge_group}
    with backend.admin() as admin:
        old_groups = [g["group_id"] for g in admin.list_groups() if g["group_id"] in groups]
        old_topics = sorted(arm_topics & set(admin.list_topics()))
        if old_groups:
            admin.delete_groups(old_groups)
        if old_topics:
            admin.delete_topics(old_topics)
    if not (old_groups or old_topics):
        return
    deadline = time.monotonic() + TOPIC_DELETE_TIMEOUT_S
    while arm_topics & set(backend.list_topics()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics {sorted(arm_topics)} still exist {TOPIC_DELETE_TIMEOUT_S:.0f} s after deletion")
        time.sleep(GROUP_POLL_S)
    progress(f"deleted the earlier run's topics {old_topics} and consumer groups {old_groups}")


def reset_registry(acfg: AppConfig, progress: Callable[[str], None]) -> None:
    """Delete the arm's registered model left by an earlier run: its ``candidate`` and
    ``champion`` aliases point at weights :func:`reset_arm` deleted, and the new learner would
    decide its first candidate against them. The earlier learner runs stay in MLflow."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

    from trainer.mlflow_store import open_client

    client = open_client(acfg.mlflow_uri)
    try:
        client.delete_registered_model(acfg.mlflow.registered_model)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        return
    progress(f"deleted the earlier run's registered model {acfg.mlflow.registered_model}")


def groups_ready(backend: KafkaBackend, group_ids: list[str]) -> bool:
    """Every group Stable, with at least one member, and every member holding partitions."""
    with backend.admin() as admin:
        listed = {g["group_id"]: g["group_state"] for g in admin.list_groups()}
        if any(listed.get(g) != "Stable" for g in group_ids):
            return False
        described = admin.describe_groups(group_ids)
    for group_id in group_ids:
        members = described[group_id].get("members") or []
        if not members or not all(_assigned_partitions(m) for m in members):
            return False
    return True


def _assigned_partitions(member: dict) -> int:
    assignment = member.get("member_assignment") or {}
    topics = assignment.get("assigned_partitions") or assignment.get("assignment") or []
    return sum(len(t.get("partitions", [])) for t in topics if isinstance(t, dict))


def wait_for_consumers(backend: KafkaBackend, group_ids: list[str], check_alive: Callable[[], None], timeout_s: float) -> float:
    """Block until :func:`groups_ready`; returns the seconds waited. ``check_alive`` raises
    when a component died meanwhile."""
    started = time.monotonic()
    while not groups_ready(backend, group_ids):
        check_alive()
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"consumer groups {group_ids} hold no partitions after {timeout_s:.0f} s")
        time.sleep(GROUP_POLL_S)
    return time.monotonic() - started


def _wait_for_rewards(stack: Stack, results_path: Path, answered: int, progress: Callable[[str], None]) -> None:
    deadline = time.monotonic() + REWARD_DRAIN_S
    while time.monotonic() < deadline:
        stack.check_alive()
        if count_reward_rows(results_path) >= answered:
            return
        time.sleep(1.0)
    progress(f"judge scored {count_reward_rows(results_path)} of {answered} answers before the drain timeout")


def pretrains(cfg: AppConfig, names: list[str]) -> bool:
    """Whether value pre-training data is needed: pre-training is on and a named arm has a critic."""
    return bool(cfg.experiment.pretrain_rollouts) and any(
        needs_critic(arm_config(cfg, a)) for a in cfg.experiment.arms if a.name in names)


def seed_config(cfg: AppConfig, k: int, out: Path) -> AppConfig:
    """``cfg`` for seed ``k`` of the scenario: ``k`` added to the traffic, prompt and learner seeds,
    results in ``out``, and a registered model of its own (``<model>.seed-<k>``, which
    :func:`~apps.experiments.scenario.arm_config` extends per arm). Every seed's run of an arm
    shared one: each run deleted the model before it started (:func:`reset_registry`), so only the
    last seed's decisions were left, and the report of seed 0 read the last seed's learner run."""
    exp = cfg.experiment
    return cfg.model_copy(update={
        "experiment": exp.model_copy(update={"seed": exp.seed + k, "prompt_seed": exp.prompt_seed + k,
                                             "results_dir": out}),
        "trainer": cfg.trainer.model_copy(update={"seed": cfg.trainer.seed + k}),
        # the mlflow section says where things go, not what a run does (resume.OUTCOME_SECTIONS):
        # a resumed sweep's finished seeds still match
        "mlflow": cfg.mlflow.model_copy(update={"registered_model": f"{cfg.mlflow.registered_model}.seed-{k}"})})


def seed_runs(cfg: AppConfig) -> list[AppConfig]:
    """One configuration per seed; a single seed keeps the scenario's own results directory."""
    out = results_dir(cfg)
    if cfg.experiment.seeds == 1:
        return [cfg]
    return [seed_config(cfg, k, out / f"seed-{k}") for k in range(cfg.experiment.seeds)]


def run_simulation(cfg: AppConfig, arms: list[str] | None = None, progress: Callable[[str], None] = print) -> Path:
    """All arms (or the named ones) for every seed, with the configured driver, then the report;
    returns the report's path. With ``experiment.resume`` the (seed, arm) runs that finished in the
    results directory with this run's settings are kept, not run again (apps/experiments/resume.py)."""
    from apps.default_model.builder import build_base_model
    from apps.experiments.pretrain_data import collect_pretrain_rollouts
    from apps.experiments.report import MlflowTarget, write_report
    from apps.experiments.style import load_or_train

    out = results_dir(cfg)
    names = arms or [a.name for a in cfg.experiment.arms]
    unknown = set(names) - {a.name for a in cfg.experiment.arms}
    if unknown:
        raise ConfigError(f"unknown arm(s) {sorted(unknown)}; the scenario has {[a.name for a in cfg.experiment.arms]}")
    check_arms_fit_the_algorithm(cfg, names)
    check_raters_fit_the_reward_range(cfg)
    if pretrains(cfg, names):
        check_pretraining_reads_every_rollout(cfg)
    refuse_other_seeds(out, cfg.experiment.seeds)
    runs = seed_runs(cfg)
    finished = finished_before(runs, names, progress) if cfg.experiment.resume else {}
    plan = [(run, [n for n in names if n not in finished.get(results_dir(run), [])]) for run in runs]
    # every directory's scenario settled before any is written: a mismatch leaves the earlier run as it was;
    # a replaced scenario takes the earlier arms' files with it (they are all rewritten)
    scenarios = {d: merged_scenario(d, scenario, running)
                 for d, (scenario, running) in {out: (cfg.experiment, names),
                                                **{results_dir(r): (r.experiment, todo) for r, todo in plan}}.items()}
    for directory, scenario in scenarios.items():
        replace_scenario(directory, scenario)
    if cfg.experiment.driver == "inprocess":
        from apps.experiments.parallel import run_arms_inprocess

        progress(f"model: {build_base_model(cfg, progress=progress)}")
        classifier = load_or_train(cfg, progress)
        run_arms_inprocess(plan, classifier, cfg.experiment.jobs, pretrains, progress)
    elif any(todo for _, todo in plan):
        resolved = out / "config.yaml"
        write_private(resolved, dump_config(cfg, reveal_secrets=True))
        with Stack(resolved, {}, out / "broker", progress=progress, resolved=True) as base:
            base.start_broker()
            progress(f"model: {build_base_model(cfg, progress=progress)}")
            classifier = load_or_train(cfg, progress)
            for k, (run, todo) in enumerate(plan):
                pretrain_file = None
                if todo and pretrains(run, todo):
                    progress(f"=== seed {k + 1}/{len(runs)}: value pre-training data, "
                             f"{run.experiment.pretrain_rollouts} rollouts ===")
                    pretrain_file = collect_pretrain_rollouts(run, classifier, progress)
                for i, name in enumerate(todo, 1):
                    progress(f"=== seed {k + 1}/{len(runs)}, arm {i}/{len(todo)}: {name} ===")
                    run_arm(run, name, progress, pretrain_file)
    report = write_report(out, out / "report", MlflowTarget.of(cfg))
    progress(f"report: {report}")
    return report


def finished_before(runs: list[AppConfig], names: list[str], progress: Callable[[str], None]) -> dict[Path, list[str]]:
    """Per seed's results directory, the arms of ``names`` whose run there finished with the settings
    this run gives them (:func:`apps.experiments.resume.finished_arms`; raises ResumeMismatch)."""
    definitions = {a.name: a for a in runs[0].experiment.arms}
    finished = {}
    for run in runs:
        directory = results_dir(run)
        finished[directory] = finished_arms(directory, names,
                                            lambda name, run=run: outcome_settings(arm_config(run, definitions[name])))
    kept = sum(len(done) for done in finished.values())
    progress(f"resume: {kept} of {len(runs) * len(names)} runs finished earlier with these settings and are kept"
             + "".join(f"; {d.name}: {', '.join(done)}" for d, done in finished.items() if done))
    return finished
