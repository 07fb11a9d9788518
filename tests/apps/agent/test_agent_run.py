"""The agent run's driver and its configuration of the stack, without processes."""

from __future__ import annotations

import asyncio

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
