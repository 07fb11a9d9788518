"""A results directory whose seeds ran different scenarios or settings is refused, not averaged as one
experiment (report, diagnostics and the drivers' comparison all read it through ``load_runs``)."""

from __future__ import annotations

import pytest

from apps.experiments.aggregate import load_runs
from apps.experiments.report import write_report
from apps.experiments.results import ArmSummary, write_scenario, write_summary
from apps.experiments.same_scenario import MixedRuns, differences
from tests.apps.experiments.test_report import SCENARIO, synthetic_rewards, write_run


def _summary(settings: dict) -> ArmSummary:
    return ArmSummary(name="sao", driver="inprocess", answered=60, failed=0, wall_s=1.0, traffic_s=1.0,
                      settings=settings)


def _seeds(directory, count: int = 3) -> None:
    for k in range(count):
        write_run(directory / f"seed-{k}", {"sao": synthetic_rewards(3, k)}, seed=k)
        write_summary(directory / f"seed-{k}", _summary({"algorithm.critic_lr": 0.0015, "trainer.seed": k}))


def test_seeds_of_one_experiment_are_read_together(tmp_path):
    """Each seed has its own experiment seed, prompt seed and learner seed: those are what seeds are."""
    _seeds(tmp_path)
    runs = load_runs(tmp_path)
    assert len(runs) == 3 and differences(runs) == []


def test_a_seed_of_another_schedule_put_in_by_hand_is_refused_naming_the_field(tmp_path):
    """A seed with its switches at 30 and 45 was averaged into the report's 'cute 0-19' column, under the
    first seed's headline, without a word."""
    _seeds(tmp_path)
    other = SCENARIO.model_copy(update={"seed": 2, "drop_rate": 0.2, "schedule": [
        {"from_rollout": 0, "style": "formal"}, {"from_rollout": 30, "style": "cute"},
        {"from_rollout": 45, "style": "archaic"}]})
    write_scenario(tmp_path / "seed-2", other)

    with pytest.raises(MixedRuns) as refused:
        write_report(tmp_path, tmp_path / "report")
    assert ("seed-2: experiment.drop_rate differs from seed-0's; seed-2: experiment.schedule differs from seed-0's"
            in str(refused.value))
    assert not (tmp_path / "report").exists()


def test_a_seed_whose_arm_ran_with_another_learning_rate_is_refused_naming_the_setting(tmp_path):
    _seeds(tmp_path)
    write_summary(tmp_path / "seed-1", _summary({"algorithm.critic_lr": 0.0005, "trainer.seed": 1}))
    with pytest.raises(MixedRuns, match=r"seed-1 sao: algorithm.critic_lr: 0.0015 -> 0.0005"):
        load_runs(tmp_path)


def test_per_run_state_directories_and_settings_added_since_are_not_differences(tmp_path):
    """Summaries of 2026-12-05/06 recorded each seed's own state directories, and a seed added later on newer
    code records settings the older seeds' summaries lack: a real ``simulate --seeds N`` directory (and its
    ``--resume``, at the end of hours of runs) was refused."""
    for k in range(3):
        write_run(tmp_path / f"seed-{k}", {"sao": synthetic_rewards(3, k)}, seed=k)
        settings = {"algorithm.critic_lr": 0.0015, "trainer.seed": k,
                    "trainer.checkpoint_dir": f"{tmp_path}/seed-{k}/arms/sao/checkpoints",
                    "serving.spool_dir": f"{tmp_path}/seed-{k}/arms/sao/spool"}
        if k == 2:
            settings["serving.device"] = "auto"  # a field added after seeds 0 and 1 ran
        write_summary(tmp_path / f"seed-{k}", _summary(settings))
    assert len(load_runs(tmp_path)) == 3


def test_a_mapping_setting_one_seed_sets_and_another_leaves_empty_is_a_difference(tmp_path):
    """An empty mapping records no key: compared on the keys both record, seeds with and without a quality
    floor were one experiment."""
    _seeds(tmp_path)
    write_summary(tmp_path / "seed-2", _summary({"algorithm.critic_lr": 0.0015, "trainer.seed": 2,
                                                 "deploy.monitor_min_scores.quality": 0.9}))
    with pytest.raises(MixedRuns, match=r"seed-2 sao: deploy.monitor_min_scores.quality: \(absent\) -> 0.9"):
        load_runs(tmp_path)


def test_a_setting_added_since_counts_only_at_its_default(tmp_path):
    _seeds(tmp_path)
    write_summary(tmp_path / "seed-2", _summary({"algorithm.critic_lr": 0.0015, "trainer.seed": 2,
                                                 "serving.device": "cpu"}))  # not the default, "auto"
    with pytest.raises(MixedRuns, match=r'serving.device: \(absent\) -> "cpu"'):
        load_runs(tmp_path)


def test_a_run_from_before_summaries_recorded_settings_is_not_compared(tmp_path):
    _seeds(tmp_path)
    write_summary(tmp_path / "seed-1", _summary({}))
    assert len(load_runs(tmp_path)) == 3


def test_the_report_command_says_what_differs_in_one_line(tmp_path, capsys):
    from apps import cli

    _seeds(tmp_path / "results")
    write_summary(tmp_path / "results" / "seed-2", _summary({"algorithm.critic_lr": 0.003, "trainer.seed": 2}))
    code = cli.main(["--set", f"paths.data_dir={tmp_path}", "--set", f"experiment.results_dir={tmp_path / 'results'}",
                     "report"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("online-sao: the seed directories of") and "Traceback" not in err
    assert "seed-2 sao: algorithm.critic_lr: 0.0015 -> 0.003" in err
