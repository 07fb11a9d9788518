"""``online-sao simulate``: run every arm of a scenario through the real service.

For each arm, one after the other with the same seeds and traffic: the arm's
resolved configuration (own topics, consumer groups, weights, checkpoints) is
written to ``<results>/arms/<arm>/config.yaml``; serving, the learner and the
judge start as their own ``online-sao`` processes on it; simulated users chat
over HTTP until the arm's rollouts are answered; then the arm is torn down and
the next one starts. The report is written at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from online_sao.config import Config, dump_config
from online_sao.experiments.results import count_reward_rows, write_scenario
from online_sao.experiments.scenario import arm_config, results_dir
from online_sao.stack import Stack

READY_TIMEOUT_S = 300.0
"""Serving loads the model and connects to the broker before /readyz answers."""
REWARD_DRAIN_S = 60.0
"""After the last answer, how long to wait for the judge to score the arm's remaining rollouts."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_private(path: Path, text: str) -> None:
    """The arm's config holds secrets: readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def run_arm(cfg: Config, arm_name: str, progress: Callable[[str], None] = print) -> dict:
    """Run one arm end to end on the already running broker; returns its summary."""
    from online_sao.experiments.simulate import drive_arm
    from online_sao.experiments.style import load_or_train
    from streams.kafka_backend import KafkaBackend

    arm = next(a for a in cfg.experiment.arms if a.name == arm_name)
    port = _free_port()
    acfg = arm_config(cfg, arm)
    acfg = acfg.model_copy(update={"serving": acfg.serving.model_copy(update={"port": port})})
    out = results_dir(cfg)
    arm_dir = out / "arms" / arm.name
    config_path = arm_dir / "config.yaml"
    _write_private(config_path, dump_config(acfg, reveal_secrets=True))
    KafkaBackend(acfg.kafka).ensure_topics()
    results_path = out / f"{arm.name}.jsonl"
    results_path.unlink(missing_ok=True)

    started = time.monotonic()
    with Stack(config_path, {}, arm_dir, progress=progress) as stack:
        server = stack.start("serving", ["serve"])
        base_url = f"http://127.0.0.1:{port}"
        stack.wait_http(server, f"{base_url}/readyz", READY_TIMEOUT_S)
        stack.start("learner", ["learn"])
        stack.start("judge", ["judge", "--arm", arm.name])
        classifier = load_or_train(acfg, progress)
        stats = asyncio.run(drive_arm(acfg, f"{base_url}/v1", None, classifier, results_path, progress=progress))
        _wait_for_rewards(stack, results_path, stats.answered, progress)
        learner_log = stack.run_dir / "logs" / "learner.log"
    summary = {"arm": arm.name, "answered": stats.answered, "failed": stats.failed,
               "wall_s": round(time.monotonic() - started, 1), "traffic_s": round(stats.wall_s, 1),
               "learner_log": str(learner_log)}
    (out / f"{arm.name}.run.json").write_text(json.dumps(summary, indent=2))
    progress(f"arm {arm.name}: {stats.answered} answered, {stats.failed} failed in {summary['wall_s']} s")
    return summary


def _wait_for_rewards(stack: Stack, results_path: Path, answered: int, progress: Callable[[str], None]) -> None:
    deadline = time.monotonic() + REWARD_DRAIN_S
    while time.monotonic() < deadline:
        stack.check_alive()
        if count_reward_rows(results_path) >= answered:
            return
        time.sleep(1.0)
    progress(f"judge scored {count_reward_rows(results_path)} of {answered} answers before the drain timeout")


def run_simulation(cfg: Config, arms: list[str] | None = None, progress: Callable[[str], None] = print) -> Path:
    """All arms (or the named ones), then the report; returns the report's path."""
    from online_sao.base_model import build_base_model
    from online_sao.experiments.report import write_report
    from online_sao.experiments.style import load_or_train

    out = results_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_scenario(out, cfg.experiment)
    names = arms or [a.name for a in cfg.experiment.arms]
    unknown = set(names) - {a.name for a in cfg.experiment.arms}
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; the scenario has {[a.name for a in cfg.experiment.arms]}")
    resolved = out / "config.yaml"
    _write_private(resolved, dump_config(cfg, reveal_secrets=True))
    with Stack(resolved, {}, out / "broker", progress=progress) as base:
        base.start_broker()
        progress(f"model: {build_base_model(cfg, progress=progress)}")
        load_or_train(cfg, progress)
        for i, name in enumerate(names, 1):
            progress(f"=== arm {i}/{len(names)}: {name} ===")
            run_arm(cfg, name, progress)
    report = write_report(out, out / "report", mlflow_uri=cfg.mlflow_uri)
    progress(f"report: {report}")
    return report
