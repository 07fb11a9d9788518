"""The ``config_changed.restart-N`` tags: each restart's settings against the previous lifetime's."""

from __future__ import annotations

from online_sao.config import Config

from tests.trainer.test_tracking import _client, cfg, empty_store  # noqa: F401 (fixtures)
from trainer.mlflow_store import MAX_VALUE_LENGTH
from trainer import tracking
from trainer.tracking import RunTracker


def _with_lr(config: Config, lr: float) -> Config:
    return config.model_copy(update={"algorithm": config.algorithm.model_copy(update={"policy_lr": lr})})


def test_a_setting_changed_then_reverted_is_tagged_on_each_restart_with_its_values(cfg):  # noqa: F811
    first = RunTracker(cfg)  # policy_lr 1e-5
    first.close("KILLED")
    for lr in (1e-4, 1e-5, 1e-5):  # changed, reverted, kept
        RunTracker(_with_lr(cfg, lr), run_id=first.run_id).close("KILLED")
    tags = _client(cfg).get_run(first.run_id).data.tags
    changed = {k: v for k, v in tags.items() if k.startswith("config_changed")}
    assert changed == {"config_changed.restart-1": "algorithm.policy_lr: 1e-05 -> 0.0001",
                       "config_changed.restart-2": "algorithm.policy_lr: 0.0001 -> 1e-05"}
    assert tags["restarts"] == "3"


def test_the_tag_lists_only_the_keys_when_the_values_do_not_fit():
    previous = {"a.long": "x" * MAX_VALUE_LENGTH, "b.short": "1", "c.same": "s"}
    current = {"a.long": "y" * MAX_VALUE_LENGTH, "b.short": "2", "c.same": "s", "d.new": "n"}
    assert tracking.changed_settings_tag(previous, current) == "a.long,b.short"
    assert tracking.changed_settings_tag({"b.short": "1"}, {"b.short": "2"}) == "b.short: 1 -> 2"
    assert tracking.changed_settings_tag(previous, previous) == ""
