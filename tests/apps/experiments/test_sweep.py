"""The learning-rate sweep: its arms, and the best rate per arm."""

from __future__ import annotations

import pytest

from apps.config import load_app_config
from apps.experiments.aggregate import ArmSummaryAcrossSeeds
from apps.experiments.intervals import Interval
from apps.experiments.sweep import best_rates, parse_sweep_arm, sweep_arm_name, sweep_config


def test_every_chosen_arm_runs_once_per_rate_with_only_the_policy_rate_changed(tmp_path):
    cfg = load_app_config("configs/drift-short.yaml", environ={}, overrides={"paths.data_dir": str(tmp_path)})
    swept = sweep_config(cfg, [1e-4, 3e-4], arms=["sao", "grpo_dis_g4"])
    names = [a.name for a in swept.experiment.arms]
    assert names == ["sao_lr0.0001", "sao_lr0.0003", "grpo_dis_g4_lr0.0001", "grpo_dis_g4_lr0.0003"]
    grpo = swept.experiment.arms[3].algorithm_config(swept.algorithm)
    assert grpo.name == "grpo" and grpo.policy_lr == 3e-4 and grpo.critic_lr == cfg.algorithm.critic_lr
    assert swept.experiment.results_dir == tmp_path / "experiments" / "drift-short" / "lr-sweep"
    assert swept.experiment.schedule == cfg.experiment.schedule and swept.experiment.seed == cfg.experiment.seed
    with pytest.raises(ValueError, match="unknown"):
        sweep_config(cfg, [1e-4], arms=["nope"])
    with pytest.raises(ValueError, match="positive"):
        sweep_config(cfg, [0.0])


def test_names_round_trip_and_the_best_rate_has_the_highest_mean_reward():
    assert parse_sweep_arm(sweep_arm_name("running_mean_w8", 1e-3)) == ("running_mean_w8", 1e-3)

    def arm(name: str, reward: float) -> ArmSummaryAcrossSeeds:
        return ArmSummaryAcrossSeeds(name, 2, 10, Interval(reward, reward, reward, 2), None, [], 0, 0, None, None,
                                     None, None, None, None, [])

    arms = [arm("sao_lr0.0001", 0.2), arm("sao_lr0.0003", 0.35), arm("sao_lr0.001", 0.3), arm("grpo_lr0.001", 0.1)]
    assert best_rates(arms) == {"sao": (3e-4, 0.35), "grpo": (1e-3, 0.1)}


def test_rates_that_name_one_arm_are_refused_before_anything_is_written(tmp_path):
    """Repeated rates, or rates equal to six significant digits, made two arms of one name (the arms
    were copied in unvalidated): one ran twice, and the report could not read scenario.json."""
    from online_sao.config import ConfigError

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"\[0\.0001, 0\.0001\] as 0\.0001"):
        sweep_config(cfg, [1e-4, 1e-4], arms=["sao"])
    with pytest.raises(ConfigError, match=r"\[0\.0003, 0\.00030000001\] as 0\.0003"):
        sweep_config(cfg, [3e-4, 1e-3, 3.0000001e-4])
    assert not (tmp_path / "experiments").exists()
    assert [a.name for a in sweep_config(cfg, [3e-4, 3.001e-4], arms=["sao"]).experiment.arms] == [
        "sao_lr0.0003", "sao_lr0.0003001"]


def test_the_sweeps_scenario_is_validated_as_the_scenario_is(tmp_path, monkeypatch):
    """Built by model_copy, the sweep's arms skipped the scenario's checks; without the rates' own
    check, the scenario's refuses their clash all the same."""
    from apps.experiments import sweep

    monkeypatch.setattr(sweep, "clashing_rates", lambda rates: {}, raising=False)  # raising=False: absent before the fix
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="arm names must be unique"):
        sweep_config(cfg, [1e-4, 1e-4], arms=["sao"])
