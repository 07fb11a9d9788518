"""What every arm of the experiment shares: prompts, per-arm configuration, where results go.

Prompts come from the style corpus. Simulated users draw from the *training*
prompts; held-out style accuracy is measured on *held-out* prompts, split the way
the base model split them (apps/default_model/builder.py: HELDOUT_FRACTION and
``model.base.seed``), so the policy never saw an evaluation prompt in pre-training.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from apps.config import AppConfig, ArmConfig, ExperimentConfig
from apps.default_model.corpus import is_heldout, iter_prompts

BASE_MODEL_HELDOUT_FRACTION = 0.1
"""Equal to apps.default_model.builder.HELDOUT_FRACTION (a test checks it; importing that module
here would pull in transformers for every caller)."""


def training_prompts(split_seed: int) -> list[str]:
    return [p for _, _, p in iter_prompts() if not is_heldout(p, BASE_MODEL_HELDOUT_FRACTION, split_seed)]


def heldout_prompts(split_seed: int) -> list[str]:
    return [p for _, _, p in iter_prompts() if is_heldout(p, BASE_MODEL_HELDOUT_FRACTION, split_seed)]


def prompt_pool(exp: ExperimentConfig, split_seed: int) -> list[str]:
    """``exp.prompt_pool_size`` training prompts (all of them if fewer), chosen by ``exp.prompt_seed``."""
    prompts = training_prompts(split_seed)
    return random.Random(exp.prompt_seed).sample(prompts, min(exp.prompt_pool_size, len(prompts)))


def eval_prompts(exp: ExperimentConfig, split_seed: int) -> list[str]:
    """``exp.eval_prompts`` held-out prompts (all of them if fewer), the same at every measurement."""
    prompts = heldout_prompts(split_seed)
    return random.Random(exp.prompt_seed).sample(prompts, min(exp.eval_prompts, len(prompts)))


def prompt_order(prompts: list[str], seed: int, repeats: int) -> Iterator[str]:
    """Endless prompts of simulated users: a seeded shuffle of the pool per pass, each prompt
    ``repeats`` times in a row."""
    rng = random.Random(seed)
    while True:
        for prompt in rng.sample(prompts, len(prompts)):
            for _ in range(repeats):
                yield prompt


def arrival_gaps(seed: int, rate: float) -> Iterator[float]:
    """Seconds between two simulated requests: a seeded Poisson process of ``rate`` per second."""
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(rate)


def segment_draws(exp: ExperimentConfig) -> Iterator[str | None]:
    """The user segment of each simulated request in send order: drawn with the segments' shares
    from a generator seeded by ``exp.seed`` (its own stream, so adding segments leaves the
    traffic's timing and prompts as they were); None for every request without segments."""
    if not exp.segments:
        while True:
            yield None
    rng = random.Random(f"segments-{exp.seed}")
    names = [s.name for s in exp.segments]
    weights = [s.share for s in exp.segments]
    while True:
        yield rng.choices(names, weights)[0]


def prompt_repeats(cfg: AppConfig) -> int:
    """How often simulated users send each drawn prompt in a row: grpo learns from groups of
    ``group_size`` answers to one prompt (trainer/join.py groups rollouts by prompt)."""
    return cfg.algorithm.group_size if cfg.algorithm.name == "grpo" else 1


def results_dir(cfg: AppConfig) -> Path:
    exp = cfg.experiment
    return (exp.results_dir or cfg.data_dir / "experiments" / exp.name).expanduser().resolve()


def arm_config(cfg: AppConfig, arm: ArmConfig) -> AppConfig:
    """``cfg`` for one arm: its algorithm overrides, and topics, consumer groups, state
    directories and registered model of its own, so arms that run one after the other never
    read each other's records, weights or checkpoints, nor decide against each other's champion;
    ``experiment.arms`` holds that arm alone."""
    suffix = f"{cfg.experiment.name}.{arm.name}"
    topics = cfg.kafka.topics.model_copy(update={
        "interactions": f"{cfg.kafka.topics.interactions}.{suffix}",
        "rewards": f"{cfg.kafka.topics.rewards}.{suffix}",
        "weights": f"{cfg.kafka.topics.weights}.{suffix}",
    })
    arm_dir = results_dir(cfg) / "arms" / arm.name
    return cfg.model_copy(update={
        "algorithm": arm.algorithm_config(cfg.algorithm),
        "kafka": cfg.kafka.model_copy(update={"topics": topics}),
        "trainer": cfg.trainer.model_copy(update={
            "consumer_group": f"{cfg.trainer.consumer_group}.{suffix}",
            "weight_store": str(arm_dir / "weights"), "checkpoint_dir": arm_dir / "checkpoints"}),
        "serving": cfg.serving.model_copy(update={"spool_dir": arm_dir / "spool"}),
        # its own arm only: its algorithm section is the arm's already, against which another arm's
        # overrides may clash (checked for the sweep's arms when it starts:
        # apps/config_checks.py); the value pre-training pass, not an arm of the sweep (its name is reserved), keeps the
        # sweep's arms, which its algorithm section (the file's) fits
        "experiment": cfg.experiment.model_copy(update={
            "judge_group": f"{cfg.experiment.judge_group}.{suffix}",
            "arms": [arm] if arm in cfg.experiment.arms else cfg.experiment.arms}),
        "mlflow": cfg.mlflow.model_copy(update={"registered_model": f"{cfg.mlflow.registered_model}.{suffix}"}),
    })
