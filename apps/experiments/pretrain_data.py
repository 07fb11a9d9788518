"""Logged rollouts of the starting policy, for the value pre-training of every arm with a critic.

SAO.md section 3: before the critic is trusted it is pre-trained on logged rollouts of the
starting policy; a cold critic is the main cause of early instability. Once per simulation,
before the arms run, serving starts on the starting policy with topics of its own, simulated
users send ``experiment.pretrain_rollouts`` requests, each answer is scored as the judge scores
it under the first phase's preference, and the interaction and reward records are written as
JSON lines (the format of ``trainer.pretrain_file``). Every arm with a critic then starts its
learner with ``learn --pretrain-critic`` on that file: the same data for each of them, and none
of it in their measured traffic or their schedule's rollout count.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

from apps.config import PRETRAIN_ARM, AppConfig, ArmConfig
from apps.experiments.judge import Judge, QualityStyleJudge, Raters
from apps.experiments.judge_service import SOURCE, interaction_texts
from apps.experiments.orchestrate import READY_TIMEOUT_S, reset_arm
from apps.experiments.scenario import arm_config, prompt_pool, results_dir
from apps.experiments.simulate import SimulatedUsers
from apps.experiments.style import StyleClassifier
from apps.stack import Stack, free_port, write_private
from online_sao.config import dump_config
from online_sao.schemas import Interaction, Reward, decode, encode

PRETRAIN_FILE = "records.jsonl"
"""The records, in the pass's own directory (``<results>/arms/pretrain-data/``): the report reads
every ``*.jsonl`` of the results directory itself as an arm's results."""
FAST_REQUESTS_PER_SECOND = 100.0
"""The pass has no learner to keep up with: requests go as fast as serving answers them."""
RECORDS_TIMEOUT_S = 60.0
"""How long the pass waits for serving's interaction records to reach the broker."""


def collect_pretrain_rollouts(cfg: AppConfig, classifier: StyleClassifier,
                              progress: Callable[[str], None] = print) -> Path:
    """Answer ``experiment.pretrain_rollouts`` prompts with the starting policy through serving,
    score them under the first phase's preference, and write the records; returns the file."""
    from streams.kafka_backend import KafkaBackend

    exp = cfg.experiment
    acfg = arm_config(cfg, ArmConfig(name=PRETRAIN_ARM))
    port = free_port()
    acfg = acfg.model_copy(update={"serving": acfg.serving.model_copy(update={"port": port})})
    arm_dir = results_dir(cfg) / "arms" / PRETRAIN_ARM
    config_path = arm_dir / "config.yaml"
    write_private(config_path, dump_config(acfg, reveal_secrets=True))
    backend = KafkaBackend(acfg.kafka)
    reset_arm(acfg, backend, arm_dir, progress)
    backend.ensure_topics()

    fast = exp.model_copy(update={"requests_per_second": FAST_REQUESTS_PER_SECOND})
    with Stack(config_path, {}, arm_dir, progress=progress, resolved=True) as stack:
        server = stack.start("serving", ["serve"])
        stack.wait_http(server, f"http://127.0.0.1:{port}/readyz", READY_TIMEOUT_S)
        users = SimulatedUsers(f"http://127.0.0.1:{port}/v1", None, fast, prompt_pool(exp, cfg.model.base.seed),
                               model=acfg.serving.model_name)
        asyncio.run(_send(users, exp.pretrain_rollouts))
        interactions = _read_interactions(backend, acfg, exp.pretrain_rollouts)

    preferred = exp.preferred_style(0)
    rewards = judge_rewards(interactions, QualityStyleJudge(classifier), preferred,
                            Raters(exp.rater_scale, exp.rater_offset))
    path = write_records(arm_dir / PRETRAIN_FILE, interactions, rewards)
    mean = sum(r.value for r in rewards) / len(rewards)
    progress(f"value pre-training data: {len(rewards)} rollouts of the starting policy, mean reward {mean:.3f} "
             f"({preferred} preferred) in {path}")
    return path


def judge_rewards(interactions: list[Interaction], judge: Judge, preferred: str,
                  raters: Raters | None = None) -> list[Reward]:
    """A reward per interaction, scored as the judge service scores it (same texts, same judge, the
    same raters)."""
    raters = raters or Raters()
    rewards = []
    for interaction in interactions:
        prompt, answer = interaction_texts(interaction, None)
        score = judge.score(prompt, answer, preferred)
        rewards.append(Reward(interaction_id=interaction.interaction_id, value=raters.rate(prompt, score.value).reward,
                              source=SOURCE))
    return rewards


def write_records(path: Path, interactions: list[Interaction], rewards: list[Reward]) -> Path:
    """The interactions, then their rewards, one encoded record a line (``trainer.pretrain_file``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(encode(record) + b"\n" for record in [*interactions, *rewards]))
    return path


async def _send(users: SimulatedUsers, total: int) -> None:
    try:
        await users.run(total)
    finally:
        await users.close()


def _read_interactions(backend, acfg: AppConfig, expected: int) -> list[Interaction]:
    """The first ``expected`` interaction records of the pass's topic (all of them, in order)."""
    consumer = backend.consumer([acfg.kafka.topics.interactions], group_id=None, start="earliest")
    found: list[Interaction] = []
    deadline = time.monotonic() + RECORDS_TIMEOUT_S
    try:
        while len(found) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(found)} of {expected} interaction records reached the broker "
                                   f"within {RECORDS_TIMEOUT_S:.0f} s")
            found += [decode(m.value, Interaction) for m in consumer.poll(timeout_s=1.0)]
    finally:
        consumer.close()
    return found[:expected]
