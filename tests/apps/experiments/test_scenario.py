"""The experiment's configuration section, run files, prompts and per-arm configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.default_model import builder as base_model
from apps.config import PRETRAIN_ARM, ArmConfig, ExperimentConfig, load_app_config
from online_sao.config import ConfigError
from apps.experiments.scenario import (BASE_MODEL_HELDOUT_FRACTION, arm_config, eval_prompts,
                                             heldout_prompts, prompt_pool, prompt_repeats, results_dir,
                                             training_prompts)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def phases(*pairs):
    return [{"from_rollout": r, "style": s} for r, s in pairs]


def test_defaults_follow_the_paper_and_name_every_arm():
    exp = ExperimentConfig()
    assert exp.switch_rollouts == [150, 300]
    assert [exp.preferred_style(r) for r in (0, 149, 150, 299, 300, 449)] == \
        ["formal", "formal", "cute", "cute", "archaic", "archaic"]
    assert [a.name for a in exp.arms] == ["sao", "running_mean_w8", "running_mean_w128", "grpo_dis_g4", "sao_k1",
                                          "sao_unfrozen_attention"]


@pytest.mark.parametrize("schedule, message", [
    (phases((0, "formal"), (10, "cute")), "two switches"),
    (phases((5, "formal"), (10, "cute"), (20, "terse")), "rollout 0"),
    (phases((0, "formal"), (20, "cute"), (10, "terse")), "increasing"),
    (phases((0, "formal"), (10, "formal"), (20, "terse")), "does not switch"),
    (phases((0, "formal"), (10, "gothic"), (20, "terse")), "gothic"),
    (phases((0, "formal"), (10, "cute"), (500, "terse")), "before rollouts_per_arm"),
])
def test_bad_schedules_are_named(schedule, message):
    with pytest.raises(ConfigError, match=message):
        load_app_config(environ={}, overrides={"experiment.schedule": schedule})


def test_a_style_named_twice_is_refused():
    with pytest.raises(ConfigError, match="named once"):
        load_app_config(environ={}, overrides={"experiment.styles": ["formal", "cute", "formal", "archaic"]})


def test_arm_overrides_are_validated_and_names_unique():
    with pytest.raises(ConfigError, match="running_mean_windw"):
        load_app_config(environ={}, overrides={"experiment.arms": [{"name": "a", "algorithm": {"running_mean_windw": 3}}]})
    with pytest.raises(ConfigError, match="unique"):
        load_app_config(environ={}, overrides={"experiment.arms": [{"name": "a"}, {"name": "a"}]})


@pytest.mark.parametrize("name", ["drift.yaml", "drift-short.yaml"])
def test_run_files_describe_the_experiment(name):
    exp = load_app_config(CONFIGS / name, environ={}).experiment
    assert len(exp.switch_rollouts) >= 2
    assert {"sao", "running_mean_w128", "grpo_dis_g4"} <= {a.name for a in exp.arms}


@pytest.mark.parametrize("name", ["drift.yaml", "drift-short.yaml", None])
def test_every_arm_makes_one_policy_update_per_batch(name):
    """Equal baselines: grpo's (and ppo's) clipped epochs default to 2, SAO and running_mean make one."""
    cfg = load_app_config(CONFIGS / name if name else None, environ={})
    for arm in cfg.experiment.arms:
        algorithm = arm.algorithm_config(cfg.algorithm)
        if algorithm.name in ("grpo", "ppo"):
            assert algorithm.ppo_epochs == 1, arm.name


def test_short_run_is_smaller_than_the_full_one():
    full = load_app_config(CONFIGS / "drift.yaml", environ={}).experiment
    short = load_app_config(CONFIGS / "drift-short.yaml", environ={}).experiment
    # At most half: the short run needs ~100 rollouts per phase for learning to show (docs/EXPERIMENTS.md).
    assert short.rollouts_per_arm * len(short.arms) <= full.rollouts_per_arm * len(full.arms) / 2
    assert short.rollouts_per_arm <= full.rollouts_per_arm and len(short.arms) < len(full.arms)


def test_arm_config_applies_overrides_and_separates_state(tmp_path):
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    arms = {a.name: arm_config(cfg, a) for a in cfg.experiment.arms}
    grpo, sao = arms["grpo_dis_g4"], arms["sao"]
    assert (grpo.algorithm.name, grpo.algorithm.group_size, grpo.algorithm.use_dis) == ("grpo", 4, True)
    assert arms["running_mean_w8"].algorithm.running_mean_window == 8
    assert arms["sao_k1"].algorithm.critic_updates == 1
    assert arms["sao_unfrozen_attention"].algorithm.freeze_critic_attention is False
    assert arms["sao_k1"].algorithm.eps_low == cfg.algorithm.eps_low  # the rest is inherited
    assert prompt_repeats(grpo) == 4 and prompt_repeats(sao) == 1
    for field in ("interactions", "rewards", "weights"):
        assert len({getattr(a.kafka.topics, field) for a in arms.values()}) == len(arms)
    assert len({a.trainer.consumer_group for a in arms.values()}) == len(arms)
    assert len({a.experiment.judge_group for a in arms.values()}) == len(arms)
    assert len({a.checkpoint_dir for a in arms.values()}) == len(arms)
    assert len({a.mlflow.registered_model for a in arms.values()}) == len(arms)
    assert sao.weight_store_url.startswith(str(results_dir(cfg)))
    assert cfg.algorithm.name == "sao" and cfg.kafka.topics.interactions == "sao.interactions"  # untouched


def test_an_arms_config_loads_again_when_the_sweeps_arms_clash_with_each_other(tmp_path):
    # the live driver writes each arm's config for its serve and learn processes, which load it again:
    # each arm fits the algorithm section, but one's level window and the other's shrinkage window
    # cannot both be on, and the arm's config holds its own merged algorithm section
    from online_sao.config import dump_config

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("experiment:\n  arms:\n"
                     "    - {name: level, algorithm: {name: sao, value_level_window: 16}}\n"
                     "    - {name: shrink, algorithm: {name: sao, value_shrinkage_window: 16}}\n")
    cfg = load_app_config(sweep, environ={}, overrides={"paths.data_dir": str(tmp_path)})
    for arm in cfg.experiment.arms:
        written = tmp_path / f"{arm.name}.yaml"
        written.write_text(dump_config(arm_config(cfg, arm), reveal_secrets=True))
        again = load_app_config(written, environ={})
        assert [a.name for a in again.experiment.arms] == [arm.name]
        assert again.algorithm == arm_config(cfg, arm).algorithm
    # the value pre-training pass runs serving from a config of its own too (apps/experiments/pretrain_data.py)
    written = tmp_path / "pretrain.yaml"
    written.write_text(dump_config(arm_config(cfg, ArmConfig(name=PRETRAIN_ARM)), reveal_secrets=True))
    assert [a.name for a in load_app_config(written, environ={}).experiment.arms] == ["level", "shrink"]


def test_prompts_train_on_the_pool_and_evaluate_on_held_out_prompts():
    assert BASE_MODEL_HELDOUT_FRACTION == base_model.HELDOUT_FRACTION
    exp = ExperimentConfig(prompt_pool_size=50, eval_prompts=10)
    pool, evals = prompt_pool(exp, 0), eval_prompts(exp, 0)
    assert len(pool) == len(set(pool)) == 50 and len(evals) == len(set(evals)) == 10
    assert set(pool) <= set(training_prompts(0)) and set(evals) <= set(heldout_prompts(0))
    assert not set(pool) & set(evals)
    assert prompt_pool(exp, 0) == pool != prompt_pool(exp.model_copy(update={"prompt_seed": 1}), 0)
    assert len(prompt_pool(ExperimentConfig(prompt_pool_size=10_000), 0)) == len(training_prompts(0))
