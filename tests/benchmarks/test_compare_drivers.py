"""benchmarks/compare_drivers.py: a directory given under the wrong driver, or drivers with no arm in
common, stop the comparison instead of comparing a driver with itself or printing an empty table."""

from __future__ import annotations

import pytest

from apps.experiments.results import write_scenario
from benchmarks.compare_drivers import main
from tests.apps.experiments.test_report import SCENARIO, synthetic_rewards, write_run


def _run(directory, driver: str, arm: str = "sao") -> str:
    write_run(directory, {arm: synthetic_rewards(3, 0)})
    write_scenario(directory, SCENARIO.model_copy(update={"seed": 0, "driver": driver}))
    return str(directory)


def test_the_same_seed_under_both_drivers_is_compared(tmp_path, capsys):
    assert main(["--live", _run(tmp_path / "live", "live"), "--inprocess", _run(tmp_path / "in", "inprocess")]) == 0
    assert "| sao | post-switch mean |" in capsys.readouterr().out


def test_a_directory_of_the_other_driver_is_refused(tmp_path):
    inprocess = _run(tmp_path / "in", "inprocess")
    with pytest.raises(SystemExit, match="not run with --driver live: .*in"):
        main(["--live", inprocess, "--inprocess", inprocess])


def test_no_arm_in_common_is_an_error_not_an_empty_table(tmp_path):
    with pytest.raises(SystemExit, match="no arm finished under both drivers"):
        main(["--live", _run(tmp_path / "live", "live", "sao"),
              "--inprocess", _run(tmp_path / "in", "inprocess", "running_mean_w8")])
