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


def test_an_artifact_store_that_fails_on_restart_falls_back_to_the_first_lifetime(cfg, monkeypatch,  # noqa: F811
                                                                                   caplog):
    """The tag only informs: a proxied artifact store's 503 (a requests error, no MlflowException) stopped
    the restart with a traceback."""
    import requests

    first = RunTracker(cfg)  # policy_lr 1e-5
    first.close("KILLED")

    def unavailable(*args, **kwargs):
        raise requests.HTTPError("503 Server Error: Service Unavailable")

    from mlflow import MlflowClient

    monkeypatch.setattr(MlflowClient, "download_artifacts", unavailable)
    with caplog.at_level("WARNING", logger="trainer.tracking"):
        RunTracker(_with_lr(cfg, 1e-4), run_id=first.run_id).close("KILLED")
    tags = _client(cfg).get_run(first.run_id).data.tags
    assert tags["config_changed.restart-1"] == "algorithm.policy_lr: 1e-05 -> 0.0001"  # against the params
    assert "could not be read (503 Server Error" in caplog.text
