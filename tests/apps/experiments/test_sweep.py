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
