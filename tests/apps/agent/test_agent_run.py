"""The agent run's driver and its configuration of the stack, without processes."""

from __future__ import annotations

import asyncio
import json

import pytest

from apps.agent.episode import Episode
from apps.agent.run import agent_config, agent_tasks, drive
from apps.config import AgentConfig, load_app_config
from apps.default_model.tool_corpus import generate_tool_corpus


class CountingAgent:
    """Answers every task at once with reward 1."""

    def __init__(self):
        self.indices: list[int] = []

    async def run(self, index, task) -> Episode:
        self.indices.append(index)
        return Episode(index=index, question=task.question, expected=task.result, tool_uses=[],
                       final_answer=task.answer, interaction_ids=[f"id{index}"], policy_version=0, called=True,
                       call_correct=True, answer_correct=True, reward=1.0, finished_at=float(index), latency_s=0.0)


def test_drive_runs_every_task_and_writes_one_row_each(tmp_path):
    agent, lines = CountingAgent(), []
    settings = AgentConfig(tasks=6, requests_per_second=1000.0, progress_every=3)
    episodes, failed = asyncio.run(drive(agent, settings, tmp_path / "episodes.jsonl", lines.append))
    assert sorted(agent.indices) == list(range(6)) and failed == 0 and len(episodes) == 6
    assert len((tmp_path / "episodes.jsonl").read_text().splitlines()) == 6
    assert [line.split(":")[0] for line in lines] == ["task 3/6", "task 6/6"]


def test_drive_starts_no_task_once_a_process_of_the_stack_exited(tmp_path):
    agent, calls = CountingAgent(), []

    def check_alive():
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("learner exited with 1")

    settings = AgentConfig(tasks=6, requests_per_second=1000.0)
    with pytest.raises(RuntimeError, match="learner exited"):
        asyncio.run(drive(agent, settings, tmp_path / "episodes.jsonl", lambda _: None, check_alive))
    assert sorted(agent.indices) == [0, 1]


def test_tasks_are_seeded_and_not_the_corpus_stream():
    assert agent_tasks(0, 20) == agent_tasks(0, 20) != agent_tasks(1, 20)
    assert agent_tasks(0, 20) != generate_tool_corpus(0, 20)


def test_the_run_has_topics_group_and_state_of_its_own(tmp_path):
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "agent.name": "a1"})
    acfg = agent_config(cfg, port=12345)
    topics = acfg.kafka.topics
    assert {topics.interactions, topics.rewards, topics.weights} == {
        "sao.interactions.agent.a1", "sao.rewards.agent.a1", "sao.weights.agent.a1"}
    assert acfg.trainer.consumer_group.endswith(".agent.a1") and acfg.experiment.judge_group.endswith(".agent.a1")
    state = tmp_path.resolve() / "agent" / "a1" / "run"
    assert acfg.checkpoint_dir == state / "checkpoints" and acfg.serving.spool_dir == state / "spool"
    assert acfg.serving.port == 12345
    assert acfg.mlflow.registered_model == f"{cfg.mlflow.registered_model}.agent.a1"  # not production's model


def test_trained_evidence_counts_the_tool_calling_turns_trained_inside_their_continuations(tmp_path):
    """A trajectory's unrated first turn trains inside the rewarded continuation: the ledger lists
    it among the step's ``turns``, and it was trained on (it was missing from the count)."""
    import torch

    from apps.agent.run import trained_evidence
    from streams.base import TopicPartition
    from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    checkpointer = Checkpointer(cfg.checkpoint_dir)
    checkpointer.record_trained(1, ["second-turn"], turns_of=["first-turn"])
    state = LearnerState(step=1, version=1, offsets={TopicPartition("sao.interactions", 0): 1}, joiner={"waiting": []})
    checkpointer.save(Checkpoint(state, models={"policy": {"w": torch.zeros(2)}}, optimizers={}))
    with_tool = Episode(index=0, question="q", expected="4", tool_uses=[], final_answer="4",
                        interaction_ids=["first-turn", "second-turn"], policy_version=1, called=True,
                        call_correct=True, answer_correct=True, reward=1.0, finished_at=0.0, latency_s=0.0)
    assert trained_evidence(cfg, [with_tool]) == {"trained_interactions": 2, "trained_rewarded_trajectories": 1,
                                                  "trained_tool_trajectories": 1, "tool_trajectories": 1}


def _api_error(message: str):
    import httpx
    import openai

    return openai.APIError(message, httpx.Request("POST", "http://127.0.0.1/v1/chat/completions"), body=None)


class RefusedAgent:
    """Every task refused as serving refuses a prompt over ``serving.max_prompt_tokens``."""

    async def run(self, index, task) -> Episode:
        raise _api_error(f"Error code: 400 - the prompt has {90 + index} tokens; this server accepts at most 50\n"
                         "(serving.max_prompt_tokens)")


def test_every_task_failing_ends_the_run_with_the_operator_error_and_the_last_failure():
    """Fewer tasks than MAX_CONSECUTIVE_FAILURES, all failing: the run ended in write_results' bare
    ``RuntimeError: no task finished`` (a traceback) instead of the one-line operator error."""
    from apps.agent.run import TasksFailing

    settings = AgentConfig(tasks=5, requests_per_second=1000.0, concurrency=1)
    with pytest.raises(TasksFailing) as failing:
        asyncio.run(drive(RefusedAgent(), settings, None, lambda _: None))
    assert str(failing.value) == ("all 5 tasks failed; last error: Error code: 400 - the prompt has 94 tokens; this "
                                  "server accepts at most 50 (serving.max_prompt_tokens); see the serving log")
    settings = AgentConfig(tasks=12, requests_per_second=1000.0, concurrency=1)
    with pytest.raises(TasksFailing, match=r"^10 tasks failed in a row; last error: .* 99 tokens; .*serving log$"):
        asyncio.run(drive(RefusedAgent(), settings, None, lambda _: None))


class FakeStack:
    """The stack's processes, none started."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def start_broker(self):
        return "127.0.0.1:9092"

    def start(self, name, command, env=None):
        return name

    def wait_http(self, component, url, timeout_s):
        pass

    def check_alive(self):
        pass


class FakeBroker:
    """What the broker holds of the run: its consumer groups and its topics' end offsets."""

    def __init__(self, groups: list[str], end_offset: int):
        self.groups, self.end_offset = groups, end_offset

    def admin(self):
        from contextlib import nullcontext
        from types import SimpleNamespace

        return nullcontext(SimpleNamespace(list_groups=lambda: [{"group_id": g} for g in self.groups]))

    def consumer(self, topics, **_):
        from types import SimpleNamespace

        return SimpleNamespace(end_offsets=lambda: {(t, 0): self.end_offset for t in topics}, close=lambda: None)

    def ensure_topics(self):
        pass


def _stackless_run(monkeypatch, broker: FakeBroker, drive_with):
    """``run_agent``'s own steps, on a fake stack and broker: its lines and the reset's."""
    from apps.agent import run
    from apps.default_model import builder
    from apps.experiments import orchestrate
    from apps import stack
    from streams import kafka_backend

    monkeypatch.setattr(stack, "Stack", FakeStack)
    monkeypatch.setattr(kafka_backend, "KafkaBackend", lambda cfg: broker)
    monkeypatch.setattr(builder, "build_base_model", lambda cfg, progress: "base")
    monkeypatch.setattr(orchestrate, "reset_arm", lambda acfg, backend, arm_dir, progress: progress(
        "deleted the earlier run's topics ['sao.interactions.agent.agent'] and consumer groups []"))
    monkeypatch.setattr(orchestrate, "reset_registry", lambda acfg, progress: None)
    monkeypatch.setattr(orchestrate, "wait_for_consumers", lambda *args: 0.1)
    monkeypatch.setattr(orchestrate, "learner_counters", lambda acfg: {"steps": 3.0})
    monkeypatch.setattr(run, "_drive_with", drive_with)
    monkeypatch.setattr(run, "_wait_for_training", lambda cfg, episodes, check_alive: {
        "trained_tool_trajectories": 0, "tool_trajectories": 0})


def test_a_rerun_that_fails_leaves_none_of_the_earlier_runs_results(tmp_path, monkeypatch):
    """The reset deleted episodes.jsonl but kept summary.json and success.png: a rerun that failed left
    the earlier run's summary beside no episodes."""
    from apps.agent.results import PLOT_FILE, SUMMARY_FILE
    from apps.agent.run import TasksFailing, results_dir, run_agent

    async def failing(*args):
        raise TasksFailing("10 tasks failed in a row; see the serving log")

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    out = results_dir(cfg)
    out.mkdir(parents=True)
    for name in ("episodes.jsonl", SUMMARY_FILE, PLOT_FILE, f"{SUMMARY_FILE}.partial"):
        (out / name).write_text("the earlier run's\n")
    _stackless_run(monkeypatch, FakeBroker(["sao-learner.agent.agent"], 40), failing)
    with pytest.raises(TasksFailing):
        run_agent(cfg, progress=lambda _: None)
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["config.yaml"]


def test_a_rerun_that_fails_before_its_tasks_leaves_none_of_the_earlier_runs_results(tmp_path, monkeypatch):
    """Cleared only after the broker, the model and the reset: a rerun whose broker did not start kept the
    earlier run's summary, plot and episodes."""
    from apps.agent.results import PLOT_FILE, SUMMARY_FILE
    from apps.agent.run import results_dir, run_agent
    from apps.experiments import orchestrate

    def broker_fails(*args):
        raise RuntimeError("kafka: port 9092 in use")

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    out = results_dir(cfg)
    out.mkdir(parents=True)
    for name in ("episodes.jsonl", SUMMARY_FILE, PLOT_FILE):
        (out / name).write_text("the earlier run's\n")
    _stackless_run(monkeypatch, FakeBroker([], 0), None)
    monkeypatch.setattr(orchestrate, "reset_arm", broker_fails)  # the first step that talks to the broker
    with pytest.raises(RuntimeError, match="port 9092"):
        run_agent(cfg, progress=lambda _: None)
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["config.yaml"]


@pytest.mark.parametrize("groups, end_offset, said", [([], 0, False), ([], 3, True), (["sao-learner.agent.agent"], 0, True)])
def test_the_reset_names_deleted_topics_only_when_an_earlier_run_left_something(tmp_path, monkeypatch, groups,
                                                                                end_offset, said):
    """On a fresh data directory the broker's start had just created the run's topics, and the reset said
    "deleted the earlier run's topics [...]" of them."""
    from apps.agent.results import SUMMARY_FILE
    from apps.agent.run import run_agent

    async def answered(base_url, acfg, api_key, episodes_path, progress, check_alive):
        agent = CountingAgent()
        return [await agent.run(i, task) for i, task in enumerate(agent_tasks(0, 3))], 0

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    _stackless_run(monkeypatch, FakeBroker(groups, end_offset), answered)
    lines: list[str] = []
    summary = run_agent(cfg, progress=lines.append)
    assert any(line.startswith("deleted the earlier run's topics") for line in lines) == said
    assert summary.name == SUMMARY_FILE and json.loads(summary.read_text())["learner"]["steps"] == 3.0
