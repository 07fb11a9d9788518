"""A results directory shared by runs: arms added later to a finished run are reported with it when the
scenario is the same, and refused when an earlier run's arms would be read under another scenario; and
which of its runs finished."""

from __future__ import annotations

import json
import os

import pytest

from apps.config import ArmConfig, ExperimentConfig
from apps.experiments.results import (SCENARIO_FILE, ArmSummary, ScenarioMismatch, finished_summary,
                                      merged_scenario, read_scenario, refuse_other_seeds, replace_scenario,
                                      scenario_differences, summary_path, write_scenario, write_summary)

SAO = ArmConfig(name="sao", algorithm={"name": "sao"})
MEAN = ArmConfig(name="mean", algorithm={"name": "running_mean", "running_mean_window": 8})
VARIANT = ArmConfig(name="sao_rewarm", algorithm={"name": "sao", "critic_rewarm_rollouts": 16})
FIRST = ExperimentConfig(rollouts_per_arm=400, seeds=3, driver="inprocess", arms=[SAO, MEAN])


def changed(**fields) -> ExperimentConfig:
    """FIRST with ``fields`` changed (validated)."""
    return ExperimentConfig.model_validate({**FIRST.model_dump(), **fields})


def record_scenario(directory, scenario: ExperimentConfig, arms: list[str]) -> None:
    """What simulate does with a results directory before it runs ``arms``."""
    write_scenario(directory, merged_scenario(directory, scenario, arms))


def finished_run(directory, scenario: ExperimentConfig, arms: list[str]) -> None:
    """A directory as a run of ``arms`` leaves it: its scenario and one results file per arm."""
    record_scenario(directory, scenario, arms)
    for arm in arms:
        (directory / f"{arm}.jsonl").write_text("{}\n")


def test_an_arm_added_to_a_finished_run_of_the_same_scenario_is_listed_beside_its_arms(tmp_path):
    finished_run(tmp_path, FIRST, ["sao", "mean"])
    later = changed(arms=[VARIANT], jobs=2, reference_arm="sao_rewarm")
    record_scenario(tmp_path, later, ["sao_rewarm"])
    assert [a.name for a in read_scenario(tmp_path).arms] == ["sao", "mean", "sao_rewarm"]
    assert read_scenario(tmp_path).reference_arm == "sao_rewarm"


def test_an_arm_run_again_with_another_definition_takes_its_place_in_the_list(tmp_path):
    finished_run(tmp_path, FIRST, ["sao", "mean"])
    slower = ArmConfig(name="mean", algorithm={"name": "running_mean", "running_mean_window": 128})
    record_scenario(tmp_path, changed(arms=[slower]), ["mean"])
    assert read_scenario(tmp_path).arms == [SAO, slower]


def test_a_run_of_another_scenario_is_refused_while_it_would_leave_earlier_arms_and_changes_nothing(tmp_path):
    finished_run(tmp_path, FIRST, ["sao", "mean"])
    before = (tmp_path / SCENARIO_FILE).read_text()
    other = changed(rollouts_per_arm=500, seeds=5, arms=[VARIANT])
    with pytest.raises(ScenarioMismatch, match=r"arm\(s\) \['mean', 'sao'\] from a scenario that differs in "
                                               r"rollouts_per_arm, seeds"):
        record_scenario(tmp_path, other, ["sao_rewarm"])
    assert (tmp_path / SCENARIO_FILE).read_text() == before
    # rewriting one of the two arms still leaves the other
    with pytest.raises(ScenarioMismatch, match=r"\['mean'\]"):
        record_scenario(tmp_path, changed(rollouts_per_arm=500, seeds=5, arms=[SAO]), ["sao"])


def test_a_run_of_another_scenario_that_rewrites_every_arm_replaces_the_earlier_run(tmp_path):
    finished_run(tmp_path, FIRST, ["sao", "mean"])
    other = changed(rollouts_per_arm=500)
    record_scenario(tmp_path, other, ["sao", "mean"])
    assert read_scenario(tmp_path) == other


def test_a_replaced_scenario_takes_the_earlier_arms_files_with_it(tmp_path):
    """simulate writes every directory's scenario before any arm starts; an arm's earlier files went only
    when that arm started, so a run cut short before then left the earlier scenario's finished runs under
    the new scenario.json, for `--resume` to keep and the report to read as the new scenario's."""
    for arm in ("sao", "mean"):
        finish_arm(tmp_path, FIRST, arm)
    replace_scenario(tmp_path, merged_scenario(tmp_path, changed(drop_rate=0.5), ["sao", "mean"]))
    assert read_scenario(tmp_path).drop_rate == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == [SCENARIO_FILE]
    assert finished_summary(tmp_path, "sao") is None


def test_the_same_scenario_keeps_the_finished_runs_when_rewritten(tmp_path):
    for arm in ("sao", "mean"):
        finish_arm(tmp_path, FIRST, arm)
    replace_scenario(tmp_path, merged_scenario(tmp_path, changed(arms=[VARIANT], jobs=2, resume=True), ["sao_rewarm"]))
    assert [a.name for a in read_scenario(tmp_path).arms] == ["sao", "mean", "sao_rewarm"]
    assert finished_summary(tmp_path, "sao").answered == 7 and finished_summary(tmp_path, "mean").answered == 7


def finish_arm(directory, scenario: ExperimentConfig, arm: str) -> None:
    """A finished run of ``arm`` under ``scenario``: results file, then summary."""
    record_scenario(directory, scenario, [arm])
    (directory / f"{arm}.jsonl").write_text("{}\n")
    write_summary(directory, ArmSummary(name=arm, driver="inprocess", answered=7, wall_s=1.0, traffic_s=1.0))


def test_the_run_only_fields_are_the_ones_that_may_differ():
    assert scenario_differences(FIRST, changed(arms=[VARIANT], jobs=4, results_dir="/elsewhere",
                                               reference_arm=None)) == []
    assert scenario_differences(FIRST, changed(driver="live")) == ["driver"]  # live and in-process runs do not mix
    schedule = [{"from_rollout": 0, "style": "terse"}, {"from_rollout": 100, "style": "cute"},
                {"from_rollout": 200, "style": "formal"}]
    assert scenario_differences(FIRST, changed(schedule=schedule, drop_rate=0.2)) == ["drop_rate", "schedule"]


def test_a_directory_without_a_scenario_gets_this_runs(tmp_path):
    record_scenario(tmp_path / "new", FIRST, ["sao"])
    assert json.loads((tmp_path / "new" / SCENARIO_FILE).read_text())["rollouts_per_arm"] == 400


def finish(directory) -> None:
    """What a finished run of arm ``sao`` leaves: the scenario, its results file, then its summary."""
    write_scenario(directory, FIRST)
    (directory / "sao.jsonl").write_text("{}\n")
    write_summary(directory, ArmSummary(name="sao", driver="inprocess", answered=7, wall_s=1.0, traffic_s=1.0))


def test_a_run_counts_as_finished_with_its_summary_whatever_the_files_times(tmp_path):
    assert finished_summary(tmp_path, "sao") is None  # never ran
    finish(tmp_path)
    assert finished_summary(tmp_path, "sao").answered == 7
    assert not list(tmp_path.glob("*.partial"))  # the summary was written whole
    # a copy of the directory may give the results a later time than the summary: still finished
    results = tmp_path / "sao.jsonl"
    made = summary_path(tmp_path, "sao").stat().st_mtime_ns
    os.utime(results, ns=(made + 1_000_000_000, made + 1_000_000_000))
    assert finished_summary(tmp_path, "sao").answered == 7
    summary_path(tmp_path, "sao").unlink()
    assert finished_summary(tmp_path, "sao") is None  # results without a summary: under way or cut short


def test_seed_directories_a_run_would_not_write_are_refused(tmp_path):
    """The report reads every seed-<k>/ holding a scenario: a run of fewer seeds, or of one seed
    (written beside them), would have the earlier run's seeds reported as its own."""
    for k in (0, 1, 2, 10):
        (tmp_path / f"seed-{k}").mkdir()
        write_scenario(tmp_path / f"seed-{k}", FIRST)
    (tmp_path / "seed-3").mkdir()  # no scenario: no run the report reads
    refuse_other_seeds(tmp_path, 11)
    with pytest.raises(ScenarioMismatch, match=r"run\(s\) of seed-10 from an earlier run with more seeds; a run of 3"):
        refuse_other_seeds(tmp_path, 3)
    with pytest.raises(ScenarioMismatch, match=r"run\(s\) of seed-2, seed-10 from"):
        refuse_other_seeds(tmp_path, 2)
    with pytest.raises(ScenarioMismatch, match=r"run\(s\) of seed-0, seed-1, seed-2, seed-10 from"):
        refuse_other_seeds(tmp_path, 1)
    refuse_other_seeds(tmp_path / "not-there", 1)


def test_a_run_of_several_seeds_over_a_one_seed_runs_results_is_refused(tmp_path):
    """A one-seed run keeps its results at the top of the directory; a run of several seeds replaced its
    scenario (it writes only seed-<k>/) and so deleted them, hours of finished work."""
    write_scenario(tmp_path, FIRST)
    (tmp_path / "sao.jsonl").write_text("{}\n")
    (tmp_path / "sao.summary.json").write_text("{}\n")
    refuse_other_seeds(tmp_path, 1)  # the same one-seed run again, or with --resume: its own files
    with pytest.raises(ScenarioMismatch, match=r"earlier one-seed run \(sao\.jsonl, sao\.summary\.json\); a run of 2"):
        refuse_other_seeds(tmp_path, 2)
    assert (tmp_path / "sao.jsonl").is_file()
