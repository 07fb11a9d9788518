"""``online-sao agent``: the simulated agent scenario through the live stack.

The broker, serving and the SAO learner run as their own ``online-sao`` processes
(apps/stack.py), on topics, a consumer group and state directories of the run's own,
reset at the start, so every run starts from the default model. Simulated agents
(apps/agent/episode.py) solve arithmetic tasks with the calculator tool at
``agent.requests_per_second``; each episode's reward goes through serving's feedback
path to Kafka and the learner trains on the whole trajectory (the tool results are
observation tokens). Progress lines while it runs; at the end ``summary.json`` and
``success.png`` in the results directory: the success rate over a rolling window of
tasks and by policy version, and what the learner trained on (its ledger).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import openai

from apps.agent.episode import Agent, Episode, FeedbackUnavailable
from apps.agent.results import (EPISODES_FILE, PARTIAL_SUFFIX, PLOT_FILE, SUMMARY_FILE, window_points,
                                write_results)
from apps.config import AgentConfig, AppConfig, client_api_key
from apps.default_model.tool_corpus import ToolTask, draw_task
from online_sao.config import dump_config

if TYPE_CHECKING:
    from streams.kafka_backend import KafkaBackend

Progress = Callable[[str], None]
READY_TIMEOUT_S = 300.0
"""Serving loads the model and connects to the broker before /readyz answers."""
LEARNER_READY_TIMEOUT_S = 180.0
"""The learner loads the model and opens MLflow, then must hold its partitions before tasks start."""
TRAIN_DRAIN_S = 30.0
"""After the last task, how long the learner may take to train on the last rewarded trajectories."""
DRAIN_POLL_S = 1.0
MAX_CONSECUTIVE_FAILURES = 10
"""Tasks failing in a row (after the client's own retries) that end the run: the endpoint is down."""


class TasksFailing(RuntimeError):
    """:data:`MAX_CONSECUTIVE_FAILURES` tasks failed in a row, or every task failed: the endpoint is
    down or refuses every task (its log says why), which the operator mends; ``online-sao agent`` says
    so in one line, with the last failure's message."""


def _failing(what: str, last_failure: str) -> TasksFailing:
    return TasksFailing(f"{what}; last error: {last_failure}; see the serving log")


def agent_tasks(seed: int, count: int) -> list[ToolTask]:
    """The run's tasks: the corpus's generator on a stream of its own, so tasks are not the
    corpus's examples (a few may coincide by chance: the operands are two-digit numbers)."""
    rng = random.Random(f"agent-tasks:{seed}")
    return [draw_task(rng) for _ in range(count)]


def results_dir(cfg: AppConfig) -> Path:
    return (cfg.agent.results_dir or cfg.data_dir / "agent" / cfg.agent.name).expanduser().resolve()


def agent_config(cfg: AppConfig, port: int) -> AppConfig:
    """``cfg`` with topics, consumer group, registered model and state directories of this run, serving
    on ``port``. The registered model too: under the config's own name the run's versions went into the
    production learner's model, and a rerun's first candidate was decided against the earlier run's
    champion, whose weights the reset had deleted."""
    name, state = cfg.agent.name, results_dir(cfg) / "run"
    topics = cfg.kafka.topics.model_copy(update={
        key: f"{getattr(cfg.kafka.topics, key)}.agent.{name}" for key in ("interactions", "rewards", "weights")})
    return cfg.model_copy(update={
        "kafka": cfg.kafka.model_copy(update={"topics": topics}),
        "trainer": cfg.trainer.model_copy(update={
            "consumer_group": f"{cfg.trainer.consumer_group}.agent.{name}",
            "weight_store": str(state / "weights"), "checkpoint_dir": state / "checkpoints"}),
        "serving": cfg.serving.model_copy(update={"spool_dir": state / "spool", "port": port}),
        "mlflow": cfg.mlflow.model_copy(update={"registered_model": f"{cfg.mlflow.registered_model}.agent.{name}"}),
        # no judge runs here; a name of the run's own keeps the reset away from an experiment's judge group
        "experiment": cfg.experiment.model_copy(update={"judge_group": f"{cfg.experiment.judge_group}.agent.{name}"}),
    })


async def drive(agent: Agent, settings: AgentConfig, episodes_path: Path, progress: Progress,
                check_alive: Callable[[], None] = lambda: None) -> tuple[list[Episode], int]:
    """Run every task (seeded Poisson starts, at most ``concurrency`` in flight); returns the
    episodes and the count of tasks that failed with an API error or whose reward could not be posted
    (:class:`~apps.agent.episode.FeedbackUnavailable`, after its retries). ``check_alive`` raises when a
    process of the stack has exited (no task starts then); :class:`TasksFailing` when
    :data:`MAX_CONSECUTIVE_FAILURES` tasks failed in a row or every task failed."""
    from apps.experiments.scenario import arrival_gaps

    episodes: list[Episode] = []
    failed = failures_in_row = 0
    last_failure = ""
    slots = asyncio.Semaphore(settings.concurrency)

    async def one(index: int, task: ToolTask) -> None:
        nonlocal failed, failures_in_row, last_failure
        try:
            episode = await agent.run(index, task)
        except (openai.APIError, FeedbackUnavailable) as exc:
            failed += 1
            failures_in_row += 1
            last_failure = " ".join(str(exc).split())  # serving's message, on one line
            progress(f"task {index} failed: {last_failure}")
            return
        finally:
            slots.release()
        failures_in_row = 0
        episodes.append(episode)
        with episodes_path.open("a") as fh:
            fh.write(json.dumps(episode.to_json()) + "\n")
        if len(episodes) % settings.progress_every == 0 or len(episodes) == settings.tasks:
            point = window_points(episodes, settings.window)[-1]
            progress(f"task {len(episodes)}/{settings.tasks}: success {point.success_rate:.0%}, tool called "
                     f"{point.call_rate:.0%} over the last {min(settings.window, len(episodes))} tasks "
                     f"(policy v{point.policy_version})")

    running: list[asyncio.Task] = []
    gaps = arrival_gaps(settings.seed, settings.requests_per_second)
    for index, task in enumerate(agent_tasks(settings.seed, settings.tasks)):
        await asyncio.sleep(next(gaps))
        await slots.acquire()
        check_alive()
        for started in running:
            if started.done():
                started.result()  # any other error (a bug, a refused reward: FeedbackRefused) ends the run
        if failures_in_row >= MAX_CONSECUTIVE_FAILURES:
            raise _failing(f"{failures_in_row} tasks failed in a row", last_failure)
        running.append(asyncio.create_task(one(index, task)))
    await asyncio.gather(*running)
    if not episodes:  # fewer tasks than MAX_CONSECUTIVE_FAILURES, all failed: nothing to summarise
        raise _failing(f"all {failed} tasks failed", last_failure)
    return episodes, failed


def clear_results(out: Path) -> None:
    """Delete an earlier run's results (and a half-written one's): a rerun that fails then leaves none,
    not the earlier run's ``summary.json`` and ``success.png`` beside its own episodes or none."""
    for name in (EPISODES_FILE, SUMMARY_FILE, PLOT_FILE):
        (out / name).unlink(missing_ok=True)
        (out / f"{name}{PARTIAL_SUFFIX}").unlink(missing_ok=True)


def earlier_run_left(backend: KafkaBackend, acfg: AppConfig) -> bool:
    """Whether the run's consumer groups exist or its topics ever held a record: what an earlier run
    leaves. The broker's start ensures the run's topics (``Stack.start_broker``), so on a fresh data
    directory they exist, empty, and the reset's "deleted the earlier run's topics" was untrue."""
    topics = acfg.kafka.topics
    groups = {acfg.trainer.consumer_group, acfg.experiment.judge_group}
    with backend.admin() as admin:
        if any(g["group_id"] in groups for g in admin.list_groups()):
            return True
    consumer = backend.consumer([topics.interactions, topics.rewards, topics.weights])
    try:
        return any(consumer.end_offsets().values())  # an end offset above 0: records were written, kept or not
    finally:
        consumer.close()


def trained_evidence(cfg: AppConfig, episodes: list[Episode]) -> dict:
    """What the learner's ledger says it trained on (as of its last checkpoint): interactions (an
    unrated tool-calling turn trained inside its continuation counts too), and how many of them are
    the final turn of a trajectory with a tool result in it."""
    from trainer.checkpoint import read_ledger

    trained = {iid for _, iid in read_ledger(cfg.checkpoint_dir, refused=False, turns=True)}
    with_tool = {e.interaction_ids[-1] for e in episodes if len(e.interaction_ids) > 1}
    rewarded = {e.interaction_ids[-1] for e in episodes}
    return {"trained_interactions": len(trained), "trained_rewarded_trajectories": len(trained & rewarded),
            "trained_tool_trajectories": len(trained & with_tool), "tool_trajectories": len(with_tool)}


def _wait_for_training(cfg: AppConfig, episodes: list[Episode], check_alive: Callable[[], None]) -> dict:
    """Poll the ledger until it covers every rewarded trajectory or :data:`TRAIN_DRAIN_S` passed."""
    deadline = time.monotonic() + TRAIN_DRAIN_S
    while True:
        check_alive()
        evidence = trained_evidence(cfg, episodes)
        if evidence["trained_rewarded_trajectories"] >= len(episodes) or time.monotonic() > deadline:
            return evidence
        time.sleep(DRAIN_POLL_S)


def run_agent(cfg: AppConfig, progress: Progress = print) -> Path:
    """The whole scenario; returns the path of ``summary.json``."""
    from apps.default_model.builder import build_base_model
    from apps.experiments.orchestrate import (learner_counters, learner_threads, reset_arm, reset_registry,
                                              wait_for_consumers)
    from apps.stack import Stack, free_port, threads_env, write_private
    from streams.kafka_backend import KafkaBackend

    out = results_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    clear_results(out)  # the earlier run's results: a rerun that fails at any step leaves none of them
    acfg = agent_config(cfg, free_port())
    config_path = out / "config.yaml"
    write_private(config_path, dump_config(acfg, reveal_secrets=True))
    settings, started = acfg.agent, time.monotonic()
    with Stack(config_path, {}, out / "broker", progress=progress, resolved=True) as base:
        base.start_broker()
        progress(f"model: {build_base_model(acfg, progress=progress)}")
        backend = KafkaBackend(acfg.kafka)
        # an earlier run's topics, group, weights, checkpoints; said only when there was one
        reset_arm(acfg, backend, out / "run", progress if earlier_run_left(backend, acfg) else lambda _: None)
        reset_registry(acfg, progress)  # and its registered model, whose aliases point at those weights
        backend.ensure_topics()
        with Stack(config_path, {}, out / "run", progress=progress, resolved=True) as stack:
            server = stack.start("serving", ["serve"])
            base_url = f"http://127.0.0.1:{acfg.serving.port}"
            stack.wait_http(server, f"{base_url}/readyz", READY_TIMEOUT_S)
            stack.start("learner", ["learn"], env=threads_env(learner_threads(acfg)))
            waited = wait_for_consumers(backend, [acfg.trainer.consumer_group], stack.check_alive,
                                        LEARNER_READY_TIMEOUT_S)
            progress(f"the learner holds its partitions after {waited:.1f} s; {settings.tasks} tasks start")
            api_key = client_api_key(acfg)
            episodes, failed = asyncio.run(_drive_with(base_url, acfg, api_key, out / EPISODES_FILE, progress,
                                                       stack.check_alive))
            evidence = _wait_for_training(acfg, episodes, stack.check_alive)
    summary = write_results(episodes, settings.window, failed, out, extra={
        "learner": {**evidence, "steps": learner_counters(acfg).get("steps")},
        "wall_s": round(time.monotonic() - started, 1)})
    progress(f"agent: {len(episodes)} tasks ({failed} failed), success {summary['success_rate']:.0%} overall, "
             f"{summary['first_window_success_rate']:.0%} in the first {settings.window} and "
             f"{summary['last_window_success_rate']:.0%} in the last {settings.window}; the learner trained on "
             f"{evidence['trained_tool_trajectories']} of {evidence['tool_trajectories']} tool-use trajectories; "
             f"results in {out}")
    return out / SUMMARY_FILE


async def _drive_with(base_url: str, cfg: AppConfig, api_key: str | None, episodes_path: Path,
                      progress: Progress, check_alive: Callable[[], None]) -> tuple[list[Episode], int]:
    agent = Agent(base_url, cfg.serving.model_name, cfg.agent, api_key)
    try:
        return await drive(agent, cfg.agent, episodes_path, progress, check_alive)
    finally:
        await agent.close()
