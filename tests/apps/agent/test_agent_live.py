"""``online-sao agent`` from its one command on a tiny size, through the real broker: the files it
writes, tool-use trajectories trained on by the learner, rewards joined."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from apps.agent.results import PLOT_FILE, SUMMARY_FILE
from apps.config import load_app_config
from apps.default_model import builder
from apps.default_model.tool_corpus import tool_corpus_size
from trainer.checkpoint import read_ledger

# A small model, quick to build. At the corpus's 12% tool share this size wrote
# no parseable call in 24 tasks (measured: the call's opening right, its JSON broken), so the
# fixture builds it with as many tool-use trajectories as style pairs: it then writes calls, right
# or wrong (any parsed call makes a tool-use trajectory, which is what this test needs).
TEST_TOOL_SHARE = 0.5
SMALL_TOOL_MODEL = {
    "model.base.vocab_size": 1024, "model.base.hidden_size": 64, "model.base.intermediate_size": 192,
    "model.base.num_layers": 2, "model.base.num_heads": 4, "model.base.num_kv_heads": 2,
    "model.base.max_position_embeddings": 256, "model.base.train_steps": 300, "model.base.batch_size": 32,
    "model.base.learning_rate": 5e-3,
}
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def small_tool_model(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("tool-model")
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(data_dir), **SMALL_TOOL_MODEL})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "tool_corpus_size", lambda style: tool_corpus_size(style, share=TEST_TOOL_SHARE))
        return builder.build_base_model(cfg, progress=lambda *_: None)


@pytest.mark.kafka
@pytest.mark.slow
def test_agent_command_reports_success_over_time_and_the_learner_trains_on_tool_use(
        kafka_broker, small_tool_model, tmp_path):
    name = f"t{uuid.uuid4().hex[:8]}"
    settings = {
        "paths.data_dir": str(tmp_path / "data"), "model.path": str(small_tool_model),
        "kafka.bootstrap_servers": kafka_broker.bootstrap, "kafka.partitions": 1,
        "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "mlflow.register_every": 100_000,
        "trainer.min_rollouts": 2, "trainer.max_wait_s": 1.0, "trainer.checkpoint_every": 1,
        "agent.name": name, "agent.tasks": 24, "agent.requests_per_second": 4.0, "agent.window": 8,
        "agent.progress_every": 8, "agent.max_tokens": 40,
        "mlflow.log_every_steps": 10,  # the default: summary.json's steps counted only the logged ones
    }
    args = [sys.executable, "-m", "apps.cli", "--config", "configs/agent.yaml"]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    run = subprocess.run(args + ["agent"], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "data" / "agent" / name
    assert run.stdout.strip().splitlines()[-1] == str(out / SUMMARY_FILE)
    assert any(line.startswith("task 8/24: success") for line in run.stdout.splitlines()), run.stdout
    # a fresh run: the topics the broker's start had just created are not "the earlier run's"
    assert not any(line.startswith("deleted the earlier run's") for line in run.stdout.splitlines()), run.stdout

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["tasks"] + summary["failed_tasks"] == 24 and summary["tasks"] > 0
    assert [p["tasks"] for p in summary["points"]] == list(range(1, summary["tasks"] + 1))
    assert all(0.0 <= p["success_rate"] <= 1.0 for p in summary["points"])
    assert sum(v["tasks"] for v in summary["by_version"]) == summary["tasks"]
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    with_tool = {e["interaction_ids"][-1] for e in episodes if e["tool_uses"]}
    assert with_tool, "the model made no tool call in 24 tasks"
    cfg = load_app_config(out / "config.yaml", environ={})
    trained = {iid for _, iid in read_ledger(cfg.checkpoint_dir, refused=False)}
    # the learner trains only on interactions whose reward it joined: a tool-use trajectory in the ledger
    # reached it with its tool result as observation and with the agent's reward
    assert trained & with_tool
    assert summary["learner"]["trained_tool_trajectories"] == len(trained & with_tool)
    assert summary["learner"]["steps"] >= 1
    stopped = re.search(r"learner stopped after (\d+) steps", (out / "run" / "logs" / "learner.log").read_text())
    assert stopped and summary["learner"]["steps"] == int(stopped.group(1))
