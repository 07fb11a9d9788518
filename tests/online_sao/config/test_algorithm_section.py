"""Values of the ``algorithm`` section that a rule could not honour are refused."""

import pytest
from pydantic import ValidationError

from online_sao.config import AlgorithmConfig, ConfigError, load_config


@pytest.mark.parametrize("name", ["sao", "running_mean"])
def test_use_dis_false_is_refused_for_a_rule_whose_loss_is_dis(tmp_path, name):
    """It was accepted and ignored: an ablation 'without DIS' of sao ran with DIS."""
    with pytest.raises(ValidationError, match=f"use_dis: false is not possible with name: {name}.*only grpo"):
        AlgorithmConfig(name=name, use_dis=False)
    path = tmp_path / "run.yaml"
    path.write_text(f"algorithm:\n  name: {name}\n  use_dis: false\n")
    with pytest.raises(ConfigError, match=r"algorithm: .*use_dis: false.*only grpo"):
        load_config(path, environ={})


def test_use_dis_false_by_default_name_is_refused_from_the_environment():
    with pytest.raises(ConfigError, match="name: sao"):
        load_config(None, environ={"ONLINE_SAO__ALGORITHM__USE_DIS": "false"})


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_use_dis_false_is_accepted_where_the_rule_runs_without_dis(name):
    assert AlgorithmConfig(name=name, use_dis=False).use_dis is False


@pytest.mark.parametrize("name", ["sao", "running_mean", "grpo", "ppo"])
def test_use_dis_true_is_accepted_by_every_rule(name):
    assert AlgorithmConfig(name=name).use_dis is True


@pytest.mark.parametrize("name", ["running_mean", "grpo"])
def test_normalize_advantages_is_refused_for_a_rule_that_never_whitens(tmp_path, name):
    """It was accepted and ignored: a running_mean or grpo arm 'with whitening' ran without."""
    with pytest.raises(ValidationError, match=f"normalize_advantages: true is not possible with name: {name}.*"
                                              "only sao and ppo whiten"):
        AlgorithmConfig(name=name, normalize_advantages=True)
    path = tmp_path / "run.yaml"
    path.write_text(f"algorithm:\n  name: {name}\n  normalize_advantages: true\n")
    with pytest.raises(ConfigError, match=r"algorithm: .*normalize_advantages: true.*only sao and ppo"):
        load_config(path, environ={})


@pytest.mark.parametrize("name", ["sao", "ppo"])
def test_normalize_advantages_is_accepted_where_the_rule_whitens(name):
    assert AlgorithmConfig(name=name, normalize_advantages=True).normalize_advantages is True


@pytest.mark.parametrize("name", ["sao", "running_mean", "grpo", "ppo"])
def test_normalize_advantages_false_is_accepted_by_every_rule(name):
    assert AlgorithmConfig(name=name).normalize_advantages is False
