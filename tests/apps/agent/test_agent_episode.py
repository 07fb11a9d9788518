"""One agent episode against the real app over HTTP (a scripted engine): the call is executed, its
result goes back as a continuation of the same trajectory, and the judged reward reaches the
rewards topic for the trajectory's newest interaction."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from apps.agent.episode import FEEDBACK_SOURCE, Agent
from apps.config import AgentConfig
from apps.default_model.builder import chat_text, task_segments, train_tokenizer
from apps.default_model.corpus import generate_corpus
from apps.default_model.tool_corpus import ToolTask, generate_tool_corpus, tool_call_text
from serving.app import build_app
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from streams.memory import InMemoryBackend
from tests.serving.conftest import Harness, serving_config
from tests.serving.fakes import FakeEngine

TASK = ToolTask(question="What is 17 plus 25?", expression="17 + 25", result="42", answer="17 plus 25 is 42.")


class AgentTurnsEngine(FakeEngine):
    """Writes ``first`` on a first turn and ``after_tool`` once a tool result is in the prompt."""

    def __init__(self, tokenizer, first: str, after_tool: str):
        super().__init__([])
        self.tokenizer, self.first, self.after_tool = tokenizer, first, after_tool

    async def generate(self, request):
        prompt = self.tokenizer.decode(request.prompt_ids)
        text = self.after_tool if "<|im_start|>tool\n" in prompt else self.first
        self.script = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        async for event in super().generate(request):
            yield event


@pytest.fixture(scope="module")
def tool_tokenizer():
    texts = [chat_text(e.prompt, e.answer) for e in generate_corpus(seed=0)[:200]]
    texts += ["".join(text for text, _ in task_segments(t)) for t in generate_tool_corpus(0, 50)]
    return train_tokenizer(texts, vocab_size=400, max_length=512)


@pytest.fixture
def serve(tmp_path, tool_tokenizer):
    from serving.server import BackgroundServer

    running = []

    def start(first: str, after_tool: str) -> tuple[str, Harness]:
        cfg = serving_config(tmp_path)
        backend = InMemoryBackend(cfg.kafka)
        backend.ensure_topics()
        producer = backend.producer()
        engine = AgentTurnsEngine(tool_tokenizer, first, after_tool)
        logger = InteractionLogger(producer, cfg.kafka.topics, cfg.spool_dir, LogSettings.from_config(cfg.serving))
        metrics = ServingMetrics(CollectorRegistry())
        server = BackgroundServer(build_app(engine, logger, cfg, tool_tokenizer, metrics, max_model_len=512)).start()
        running.append(server)
        return server.url, Harness(None, engine, logger, cfg, producer, backend, metrics, tool_tokenizer)

    yield start
    for server in running:
        server.stop()


def run_episode(url: str):
    async def go():
        agent = Agent(url, "online-sao", AgentConfig(max_tokens=64))
        try:
            return await agent.run(0, TASK)
        finally:
            await agent.close()
    return asyncio.run(go())


def test_a_right_call_and_a_stated_result_earn_1_for_the_whole_trajectory(serve):
    url, harness = serve(tool_call_text("17 + 25"), "17 plus 25 is 42.")
    episode = run_episode(url)
    assert [(u.name, u.result) for u in episode.tool_uses] == [("calculator", "42")]
    assert episode.final_answer == "17 plus 25 is 42." and episode.reward == 1.0
    first, second = episode.interaction_ids
    records = {r.interaction_id: r for r in harness.interactions()}
    trajectory = records[second]
    assert trajectory.parent_id == first
    observation = [t for t, action in zip(trajectory.response_ids, trajectory.action_mask) if not action]
    assert harness.tokenizer.decode(observation) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    [reward] = harness.rewards()
    assert (reward.interaction_id, reward.value, reward.source) == (second, 1.0, FEEDBACK_SOURCE)


def test_an_answer_without_a_call_earns_0(serve):
    url, harness = serve("17 plus 25 is 42.", "unused")
    episode = run_episode(url)
    assert episode.tool_uses == [] and not episode.called and episode.reward == 0.0
    [only] = episode.interaction_ids
    [reward] = harness.rewards()
    assert (reward.interaction_id, reward.value) == (only, 0.0)


def test_a_wrong_call_earns_0_although_the_answer_copies_its_result(serve):
    url, harness = serve(tool_call_text("17 + 52"), "17 plus 25 is 69.")
    episode = run_episode(url)
    assert [u.result for u in episode.tool_uses] == ["69"]
    assert episode.reward == 0.0 and len(episode.interaction_ids) == 2
    assert [r.value for r in harness.rewards()] == [0.0]
