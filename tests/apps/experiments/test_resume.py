"""Which runs of a results directory a resumed sweep keeps: finished ones (results.finished_summary)
with the settings this run would use; other settings stop the run."""

from __future__ import annotations

import pytest

from apps.config import ExperimentConfig
from apps.experiments.resume import ResumeMismatch, finished_arms, outcome_settings, setting_differences
from apps.experiments.results import ArmSummary, summary_path, write_scenario, write_summary
from apps.experiments.scenario import arm_config
from tests.fixtures.models import tiny_config

SETTINGS = {"algorithm.name": "sao", "algorithm.policy_lr": 1e-6, "trainer.min_rollouts": 4}


def test_the_settings_are_the_outcome_sections_flattened_without_the_per_run_fields(tmp_path):
    cfg = tiny_config(tmp_path, **{"serving.port": 8123, "trainer.pretrain_file": str(tmp_path / "p.jsonl"),
                                   "algorithm.policy_lr": 2e-5, "kafka.bootstrap_servers": "broker:9092",
                                   "experiment.arms": [{"name": "w8", "algorithm": {"name": "running_mean",
                                                                                     "running_mean_window": 8}}]})
    settings = outcome_settings(arm_config(cfg, cfg.experiment.arms[0]))
    # the arm's overrides on the run's algorithm section
    assert (settings["algorithm.name"], settings["algorithm.running_mean_window"], settings["algorithm.policy_lr"]) \
        == ("running_mean", 8, 2e-5)
    assert settings["drift.enabled"] is False and "serving.max_batch_size" in settings
    assert settings["model.base.num_layers"] == cfg.model.base.num_layers  # nested sections, dotted
    assert settings["serving.feedback_secret"] == "**********"  # secrets masked
    assert "serving.port" not in settings and "trainer.pretrain_file" not in settings
    assert not [k for k in settings if k.split(".")[0] in ("paths", "kafka", "mlflow", "experiment", "agent")]
    # a port of its own for every live run changes nothing
    other_port = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"port": 9999})})
    assert outcome_settings(arm_config(other_port, cfg.experiment.arms[0])) == settings
    # nor do the arm's state directories, under the results directory: a moved directory resumes
    moved = cfg.model_copy(update={"experiment": cfg.experiment.model_copy(
        update={"results_dir": tmp_path / "moved"})})
    assert arm_config(moved, cfg.experiment.arms[0]).trainer.checkpoint_dir != \
        arm_config(cfg, cfg.experiment.arms[0]).trainer.checkpoint_dir
    assert outcome_settings(arm_config(moved, cfg.experiment.arms[0])) == settings


def test_setting_differences_name_each_changed_added_and_removed_key():
    recorded = {"algorithm.policy_lr": 1e-6, "trainer.min_rollouts": 4, "drift.enabled": True}
    current = {"algorithm.policy_lr": 3e-6, "trainer.min_rollouts": 4, "serving.top_p": 0.9}
    assert setting_differences(recorded, current) == ["algorithm.policy_lr: 1e-06 -> 3e-06",
                                                      "drift.enabled: true -> (absent)",
                                                      "serving.top_p: (absent) -> 0.9"]
    assert setting_differences(recorded, dict(recorded)) == []
    # a setting a summary written before it existed does not record counts at its default (serving.device "auto")
    assert setting_differences(recorded, {**recorded, "serving.device": "auto"}) == []
    assert setting_differences(recorded, {**recorded, "serving.device": "cpu"}) == ['serving.device: (absent) -> "cpu"']


SCENARIO = ExperimentConfig(driver="inprocess")


def finish(directory, arm: str, settings: dict | None = None) -> None:
    """What a finished run of ``arm`` leaves: the directory's scenario (written before any arm starts),
    its results file, then its summary."""
    if not (directory / "scenario.json").is_file():
        write_scenario(directory, SCENARIO)
    (directory / f"{arm}.jsonl").write_text("{}\n")
    write_summary(directory, ArmSummary(name=arm, driver="inprocess", answered=1, wall_s=1.0, traffic_s=1.0,
                                        settings=SETTINGS if settings is None else settings))


def test_finished_arms_keep_runs_with_the_same_settings_and_run_older_files_again(tmp_path):
    finish(tmp_path, "sao")
    finish(tmp_path, "old", settings={})  # written before summaries recorded their settings
    (tmp_path / "cut.jsonl").write_text("{}\n")  # cut short: no summary
    assert finished_arms(tmp_path, ["sao", "old", "cut", "new"], lambda arm: dict(SETTINGS)) == ["sao"]


def test_a_summary_that_still_records_the_state_directories_resumes_elsewhere(tmp_path):
    """Summaries written before the state directories were per-run fields record them."""
    finish(tmp_path, "sao", settings={**SETTINGS, "trainer.checkpoint_dir": "/old/arms/sao/checkpoints",
                                      "serving.spool_dir": "/old/arms/sao/spool"})
    assert finished_arms(tmp_path, ["sao"], lambda arm: dict(SETTINGS)) == ["sao"]


def test_a_finished_run_with_other_settings_stops_the_resume(tmp_path):
    finish(tmp_path, "sao")
    with pytest.raises(ResumeMismatch, match=r"arm 'sao' finished with other settings than this run's: "
                                             r"algorithm.policy_lr: 1e-06 -> 3e-06\. Resuming would report"):
        finished_arms(tmp_path, ["sao"], lambda arm: {**SETTINGS, "algorithm.policy_lr": 3e-6})


def test_a_long_list_of_differences_is_cut_and_counted(tmp_path):
    many = {f"trainer.k{i}": i for i in range(12)}
    finish(tmp_path, "sao", settings=many)
    # sorted: k0, k1, k10, k11, k2 ... k5 listed, k6 ... k9 counted
    with pytest.raises(ResumeMismatch, match=r"trainer.k11: 11 -> 12; trainer.k2: 2 -> 3; .*trainer.k5: 5 -> 6 "
                                             r"\(and 4 more\)\. Resuming"):
        finished_arms(tmp_path, ["sao"], lambda arm: {k: v + 1 for k, v in many.items()})



def test_a_finished_run_of_a_replaced_scenario_is_not_kept(tmp_path):
    """A run of another scenario that reruns every arm wrote its scenario.json into the seed directory and
    was cut short before it reached sao: sao's finished run there is the earlier scenario's (drop rate 0),
    and a resume kept it, reported with the new drop rate."""
    seed_dir = tmp_path / "seed-0"
    seed_dir.mkdir()
    finish(seed_dir, "sao")
    assert finished_arms(seed_dir, ["sao"], lambda arm: dict(SETTINGS)) == ["sao"]
    write_scenario(seed_dir, SCENARIO.model_copy(update={"drop_rate": 0.5}))  # the cut-short run's
    assert finished_arms(seed_dir, ["sao"], lambda arm: dict(SETTINGS)) == []
    # what decides is the scenario, not the arms it lists, how many run side by side or resuming
    write_scenario(seed_dir, SCENARIO.model_copy(update={"jobs": 2, "resume": True, "arms": [{"name": "w8"}]}))
    assert finished_arms(seed_dir, ["sao"], lambda arm: dict(SETTINGS)) == ["sao"]


def test_a_summary_without_its_scenario_is_run_again(tmp_path):
    """Written before summaries recorded their scenario: the directory cannot tell whether its scenario was
    replaced since (older code left such runs under the replacing scenario.json)."""
    finish(tmp_path, "sao")
    path = summary_path(tmp_path, "sao")
    path.write_text(ArmSummary.model_validate_json(path.read_text()).model_dump_json(exclude={"scenario"}))
    assert finished_arms(tmp_path, ["sao"], lambda arm: dict(SETTINGS)) == []


def test_a_field_a_later_version_of_the_code_adds_leaves_a_finished_run_finished(tmp_path, monkeypatch):
    """A hash of the scenario changed with every field the code added (with its default): every run stopped
    counting as finished and --resume ran them all again, with nothing said."""
    import json

    finish(tmp_path, "sao")
    path = summary_path(tmp_path, "sao")
    summary = json.loads(path.read_text())
    del summary["scenario"]["drop_rate"]  # a summary written by code that did not have the field yet
    path.write_text(json.dumps(summary))
    assert finished_arms(tmp_path, ["sao"], lambda arm: dict(SETTINGS)) == ["sao"]
