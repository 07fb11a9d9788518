"""Checks of an application's configuration that its command makes before it starts anything: each
setting is valid alone and at load, but together they would fail the run after all its setup (or
leave part of it out without a word). A command that does not run that part does not check it."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationError

from apps.config import AppConfig, client_api_key
from apps.default_model.corpus_content import TOPICS
from online_sao.config import ConfigError


def check_pretraining_reads_every_rollout(cfg: AppConfig) -> None:
    """ConfigError when ``experiment.pretrain_rollouts`` is above ``trainer.pretrain_max_rollouts``, the
    most the value pre-training pass reads: the rest were answered and scored, then left out without a
    word. Checked by the experiment when it pre-trains, not at load: a cap set for ``learn
    --pretrain-critic`` alone is valid for every other command."""
    asked, kept = cfg.experiment.pretrain_rollouts, cfg.trainer.pretrain_max_rollouts
    if asked > kept:
        raise ConfigError(f"experiment.pretrain_rollouts = {asked} is above trainer.pretrain_max_rollouts = {kept}, "
                          "the most value pre-training reads: lower the one or raise the other")


def check_arms_fit_the_algorithm(cfg: AppConfig, names: list[str] | None = None) -> None:
    """ConfigError naming the first arm whose algorithm overrides, applied to ``cfg``'s ``algorithm``
    section as the arm will run (``ArmConfig.algorithm_config``), clash with it (``value_shrinkage_window``
    on top of a ``value_level_window``): the arm failed only when it started, hours into a sweep. Checked
    by the simulation before it runs arms (``simulate``, ``lr-sweep``), not at load: the default arms
    made ``learn`` and ``serve`` refuse valid settings of their own (``algorithm.critic_trainable_layers``
    clashed with the default ``sao_unfrozen_attention`` arm). ``names``: the arms to run (None: all)."""
    for index, arm in enumerate(cfg.experiment.arms):
        if names is not None and arm.name not in names:
            continue
        try:
            arm.algorithm_config(cfg.algorithm)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'algorithm'}: {e['msg']}"
                                 for e in exc.errors())
            raise ConfigError(f"experiment.arms[{index}] (arm {arm.name!r}): its algorithm overrides on top of "
                              f"the algorithm section: {problems}") from None


def check_raters_fit_the_reward_range(cfg: AppConfig) -> None:
    """ConfigError when the rewards the experiment's raters give (the judge's value in [0, 1] x a topic's
    ``rater_scale`` + its ``rater_offset``; 1 and 0 for a topic not named) leave ``reward.min_value``..
    ``max_value``: the learner dead-letters such a reward, so a generous topic lost only its good answers'
    rewards (the live driver; the in-process one trained them) and the experiment ran on, biased. Checked
    by the simulation when it starts, not at load: a narrow range is valid for a learner that runs no
    experiment."""
    exp, reward = cfg.experiment, cfg.reward
    for topic in [t.name for t in TOPICS]:
        scale, offset = exp.rater_scale.get(topic, 1.0), exp.rater_offset.get(topic, 0.0)
        low, high = offset, scale + offset
        if low < reward.min_value or high > reward.max_value:
            raise ConfigError(f"the experiment's raters of topic {topic!r} give rewards in [{low:g}, {high:g}] (the "
                              f"judge's 0..1 x {scale:g} {offset:+g}), outside reward.min_value..max_value "
                              f"[{reward.min_value:g}, {reward.max_value:g}], whose rewards the learner refuses")


def check_requests_fit_serving(cfg: AppConfig, scenario: Literal["experiment", "agent"]) -> None:
    """ConfigError when ``<scenario>.max_tokens`` is above ``serving.max_new_tokens`` (serving refuses
    each such request: the run died on its first one, after all its setup). Checked by the commands
    that send them, not at load: a serving-only configuration with a small limit is valid."""
    asked, limit = getattr(cfg, scenario).max_tokens, cfg.serving.max_new_tokens
    if asked > limit:
        raise ConfigError(f"{scenario}.max_tokens = {asked} is above serving.max_new_tokens = {limit}, the most "
                          "a request may ask for: lower the one or raise the other")


def check_agent_rewards_are_taken(cfg: AppConfig) -> None:
    """ConfigError when the rewards ``online-sao agent`` sends (``source``
    ``apps.agent.episode.FEEDBACK_SOURCE``, with the key :func:`client_api_key` names) would be refused by
    serving (``serving.feedback_sources``, ``serving.source_keys``: the rule of ``serving/feedback.py``)
    or ignored by the learner (``reward.sources``), or whose values (0 and 1) lie outside the reward range.
    Either way the run did all its setup, then died on its first reward (403) or trained on nothing
    without a word."""
    from apps.agent.episode import FEEDBACK_SOURCE  # imported here: the agent imports this module
    from apps.agent.judge import FAILURE_REWARD, SUCCESS_REWARD
    from serving.auth import key_name, source_callers

    source, serving = FEEDBACK_SOURCE, cfg.serving
    if serving.feedback_sources is not None and source not in serving.feedback_sources:
        raise ConfigError(f"serving.feedback_sources ({serving.feedback_sources}) does not allow {source!r}, the "
                          "source of the agent's rewards: serving would refuse every one (403); add it")
    owners = source_callers(serving.source_keys).get(source)
    key = client_api_key(cfg)
    caller = None if key is None else key_name(key.encode("utf-8"))  # the name serving's ApiKeyAuth gives it
    if owners is not None and caller not in owners:
        raise ConfigError(f"serving.source_keys.{source} does not hold the key the agent sends (the first of "
                          "serving.api_keys): serving would refuse every reward of the agent (403); add it there")
    low, high = cfg.reward.min_value, cfg.reward.max_value
    outside = [value for value in (FAILURE_REWARD, SUCCESS_REWARD) if not low <= value <= high]
    if outside:
        raise ConfigError(f"reward.min_value..max_value ({low:g}..{high:g}) leaves out the agent's reward "
                          f"{outside[0]:g}: serving would refuse it (422); widen the range")
    trusted = cfg.reward.sources
    if trusted is not None and source not in trusted:
        raise ConfigError(f"reward.sources ({trusted}) does not include {source!r}, the source of the agent's "
                          "rewards: the learner would ignore every one and train on nothing; add it")
