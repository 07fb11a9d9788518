"""An experiment's settings that clash with other sections are refused before it runs, not when the
arm starts, hours into a sweep: an arm's override of no field at load; its overrides applied to the
algorithm section, and its value pre-training's size, when the experiment starts (the default arms
made learn and serve refuse valid algorithm settings of their own)."""

import pytest

from apps.config import load_app_config
from apps.config_checks import check_arms_fit_the_algorithm
from online_sao.config import ConfigError


def test_an_arm_whose_overrides_clash_with_the_algorithm_section_is_refused_by_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  value_level_window: 16\nexperiment:\n  arms:\n"
                    "    - name: a\n      algorithm: {name: sao}\n"
                    "    - name: clashing_arm\n      algorithm: {name: sao, value_shrinkage_window: 16}\n")
    cfg = load_app_config(path, environ={})
    with pytest.raises(ConfigError, match=r"experiment\.arms.*'clashing_arm'.*set one of them") as raised:
        check_arms_fit_the_algorithm(cfg)
    assert "\n" not in str(raised.value)


def test_the_clash_coming_from_an_override_of_the_algorithm_section_is_refused_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("experiment:\n  arms:\n    - name: b\n      algorithm: {value_shrinkage_window: 16}\n")
    check_arms_fit_the_algorithm(load_app_config(path, environ={}))
    with pytest.raises(ConfigError, match=r"'b'"):
        check_arms_fit_the_algorithm(load_app_config(path, environ={"ONLINE_SAO__ALGORITHM__VALUE_LEVEL_WINDOW":
                                                                     "16"}))


def test_arms_that_fit_the_algorithm_section_still_load():
    cfg = load_app_config(environ={})
    assert [a.algorithm_config(cfg.algorithm).name for a in cfg.experiment.arms][:2] == ["sao", "running_mean"]


def test_simulate_reports_the_clashing_arm_in_one_line_before_anything_runs(tmp_path, capsys):
    from apps import cli
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  value_level_window: 16\nexperiment:\n  arms:\n"
                    "    - name: b\n      algorithm: {name: sao, value_shrinkage_window: 16}\n")
    assert cli.main(["-c", str(path), "--set", f"paths.data_dir={tmp_path / 'data'}", "simulate"]) == 2
    assert not (tmp_path / "data").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'b'" in err[0]


def test_an_override_that_fits_its_section_but_not_the_defaults_loads(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  name: grpo\nexperiment:\n  arms:\n    - name: plain_grpo\n"
                    "      algorithm: {use_dis: false}\n")
    cfg = load_app_config(path, environ={})
    assert cfg.experiment.arms[0].algorithm_config(cfg.algorithm).use_dis is False


def test_an_override_that_does_not_fit_its_section_is_refused_by_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("experiment:\n  arms:\n    - name: sao_without_dis\n      algorithm: {use_dis: false}\n")
    with pytest.raises(ConfigError, match=r"'sao_without_dis'.*use_dis"):
        check_arms_fit_the_algorithm(load_app_config(path, environ={}))


def test_an_override_of_no_field_is_refused_at_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("experiment:\n  arms:\n    - name: bad\n      algorithm: {no_such_field: 1}\n")
    with pytest.raises(ConfigError, match="no_such_field"):
        load_app_config(path, environ={})


def test_an_override_of_a_wrong_type_is_refused_before_the_experiment_runs(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("experiment:\n  arms:\n    - name: bad\n      algorithm: {policy_lr: fast}\n")
    with pytest.raises(ConfigError, match=r"'bad'.*policy_lr"):
        check_arms_fit_the_algorithm(load_app_config(path, environ={}))


def test_more_pretrain_rollouts_than_pretraining_reads_are_refused_by_an_experiment_that_pretrains(tmp_path):
    """Refused before anything is run or written; any other command loads such a configuration
    (a cap set for ``learn --pretrain-critic`` alone stopped serve, learn and kafka at load)."""
    from apps.experiments.orchestrate import run_simulation

    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data"),
                                                 "trainer.pretrain_max_rollouts": 100,
                                                 "experiment.pretrain_rollouts": 101})
    with pytest.raises(ConfigError, match=r"experiment\.pretrain_rollouts = 101 .* trainer\.pretrain_max_rollouts = 100"):
        run_simulation(cfg, arms=["sao"], progress=lambda line: None)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("settings", [{"algorithm.critic_trainable_layers": 2},
                                      {"algorithm.name": "grpo", "algorithm.use_dis": False}])
def test_the_default_arms_do_not_refuse_a_learners_own_algorithm_settings(settings, capsys):
    """critic_trainable_layers clashed with the default arm sao_unfrozen_attention, grpo without DIS with
    the default arm sao: learn and serve refused valid settings for arms they never run."""
    from apps import cli

    argv = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    assert cli.main([*argv, "config", "show"]) == 0, capsys.readouterr().err


def test_only_the_arms_a_simulation_runs_are_checked():
    """`simulate --arm sao` with critic_trainable_layers set was refused for the default arm
    sao_unfrozen_attention, which it was not going to run."""
    cfg = load_app_config(environ={}, overrides={"algorithm.critic_trainable_layers": 2})
    check_arms_fit_the_algorithm(cfg, ["sao"])
    with pytest.raises(ConfigError, match="'sao_unfrozen_attention'"):
        check_arms_fit_the_algorithm(cfg)
