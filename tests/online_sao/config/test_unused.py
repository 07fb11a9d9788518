"""Settings the configured rule or a drift response that is off never reads are named (the learner warns with
them at start): set, they changed nothing, while MLflow recorded them as the run's parameters."""

from __future__ import annotations

import pytest

from online_sao.config import load_config
from online_sao.config.algorithm import AlgorithmConfig
from online_sao.config.unused import READ_BY, unread_settings


def _unread(**settings) -> list[str]:
    cfg = load_config(environ={}, overrides=settings)
    return unread_settings(cfg.algorithm, cfg.drift)


def test_the_defaults_leave_nothing_unread():
    assert _unread() == []


def test_sao_options_under_ppo_are_named():
    """A live ppo learner with these four started without a word and ran none of them."""
    assert _unread(**{"algorithm.name": "ppo", "algorithm.critic_order": "replay_then_judge",
                      "algorithm.value_level_window": 16, "algorithm.critic_updates": 3,
                      "algorithm.critic_lr": 1e-3}) == [
        "algorithm.critic_updates", "algorithm.critic_order", "algorithm.value_level_window"]


@pytest.mark.parametrize("name, unread", [
    ("running_mean", ["algorithm.critic_lr", "algorithm.group_size"]),  # no critic, no groups
    ("grpo", ["algorithm.critic_lr", "algorithm.running_mean_window"]),
    ("sao", ["algorithm.running_mean_window", "algorithm.group_size"]),
])
def test_each_rule_names_the_settings_of_the_others(name, unread):
    assert _unread(**{"algorithm.name": name, "algorithm.critic_lr": 1e-3, "algorithm.group_size": 8,
                      "algorithm.running_mean_window": 16}) == unread


def test_the_drift_responses_settings_without_it_are_named():
    settings = {"drift.rollback_first": True, "drift.z_threshold": 4.0, "algorithm.critic_rewarm_rollouts": 8}
    assert _unread(**settings) == ["drift.z_threshold", "drift.rollback_first", "algorithm.critic_rewarm_rollouts"]
    assert _unread(**settings, **{"drift.enabled": True}) == []


@pytest.mark.parametrize("name, named", [("running_mean", True), ("grpo", True), ("sao", False), ("ppo", False)])
def test_a_discount_the_rules_without_a_critic_never_read_is_named(name, named):
    assert (_unread(**{"algorithm.name": name, "algorithm.gamma": 0.9}) == ["algorithm.gamma"]) == named


def test_every_listed_setting_is_an_algorithm_setting():
    assert set(READ_BY) <= set(AlgorithmConfig.model_fields)
