"""The in-process driver's runs side by side in worker processes: the same results files as one
after the other, summaries beside them, and the configuration's limits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from apps.config import ExperimentConfig
from apps.experiments.orchestrate import pretrains, seed_runs
from apps.experiments.parallel import run_arms_inprocess
from apps.experiments.results import decisions, read_arm, summary_path, write_scenario
from apps.experiments.scenario import results_dir
from tests.apps.experiments import sweep_jobs
from tests.apps.experiments.test_inprocess import scenario
from tests.fixtures.models import tiny_config
from tests.fixtures.processes import gone, kill_leftovers, wait_until, with_terminal_sigint

REPO = Path(__file__).resolve().parents[3]
STARTED_TIMEOUT_S = 120.0
"""Bound on the workers' start (spawned interpreters importing the driver on two busy cores)."""
STOPPED_TIMEOUT_S = 60.0
"""Bound on the interrupted sweep's exit, and on its workers' end after it."""
ARMS = [{"name": "sao"}, {"name": "rm", "algorithm": {"name": "running_mean", "running_mean_window": 4}}]


def sweep(where, tiny_model_dir, classifier, jobs: int, lines: list[str]):
    cfg = tiny_config(where / "data", **{"model.path": str(tiny_model_dir), "experiment.arms": ARMS,
                                         "experiment.results_dir": str(where / "results"), "experiment.seeds": 2,
                                         "experiment.driver": "inprocess", "experiment.jobs": jobs,
                                         "serving.torch_threads": 1,
                                         **scenario(**{"experiment.pretrain_rollouts": 6})})
    runs = seed_runs(cfg)
    names = [a["name"] for a in ARMS]
    run_arms_inprocess([(run, names) for run in runs], classifier, jobs, pretrains, lines.append)
    return runs


def outcome(runs, arm: str):
    """What the arm's run of each seed decided (rewards, versions, styles, step metrics)."""
    return [decisions(read_arm(results_dir(run) / f"{arm}.jsonl")) for run in runs]


def test_side_by_side_runs_write_what_one_after_the_other_writes(tmp_path, tiny_model_dir, style_classifier):
    serial_lines, parallel_lines = [], []
    serial = sweep(tmp_path / "serial", tiny_model_dir, style_classifier, 1, serial_lines)
    parallel = sweep(tmp_path / "parallel", tiny_model_dir, style_classifier, 2, parallel_lines)
    for arm in ("sao", "rm"):
        first, second = outcome(serial, arm), outcome(parallel, arm)
        assert first == second
        assert first[0] != first[1]  # the two seeds are different runs
        assert all(steps and steps[-1][0] >= 1 for _, steps in first)  # and both trained
    for run in parallel:
        for arm in ("sao", "rm"):
            assert summary_path(results_dir(run), arm).is_file()
        assert (results_dir(run) / "arms" / "pretrain-data" / "records.jsonl").is_file()
    assert "2 at a time in worker processes" in parallel_lines[0]
    assert parallel_lines[-1].startswith("=== 4/4 runs done")


def test_a_failing_run_stops_the_sweep_with_its_error(tmp_path, style_classifier):
    (tmp_path / "no-model").mkdir()  # a model directory without a model: every run fails to load it
    cfg = tiny_config(tmp_path / "data", **{"model.path": str(tmp_path / "no-model"), "experiment.arms": ARMS,
                                            "experiment.results_dir": str(tmp_path / "results"),
                                            "experiment.seeds": 2, "experiment.driver": "inprocess",
                                            "serving.torch_threads": 1, **scenario()})
    lines = []
    # transformers' error for a directory without a model (OSError or ValueError, by version), raised here
    with pytest.raises((OSError, ValueError)) as raised:
        run_arms_inprocess([(run, ["rm"]) for run in seed_runs(cfg)], style_classifier, 2,
                           lambda run, names: False, lines.append)
    assert "_RemoteTraceback" in repr(raised.value.__cause__)  # it came from a worker process
    assert any("failed; the runs under way finish" in line for line in lines)


def test_jobs_need_the_inprocess_driver():
    with pytest.raises(ValidationError, match="jobs = 2 needs driver 'inprocess'"):
        ExperimentConfig(jobs=2)
    assert ExperimentConfig(jobs=2, driver="inprocess").jobs == 2
    with pytest.raises(ValidationError):
        ExperimentConfig(jobs=0, driver="inprocess")


def test_the_jobs_flag_sets_the_configured_jobs():
    from apps import cli, commands

    args = cli.build_parser().parse_args(["simulate", "--driver", "inprocess", "--seeds", "4", "--jobs", "2"])
    assert commands.overrides(args) == {"experiment.seeds": 4, "experiment.driver": "inprocess", "experiment.jobs": 2}
    args = cli.build_parser().parse_args(["lr-sweep", "--rates", "1e-4", "--jobs", "3"])
    assert commands.overrides(args)["experiment.jobs"] == 3


def test_side_by_side_a_seed_without_arms_to_run_is_left_alone(tmp_path, tiny_model_dir, style_classifier):
    """What a resumed sweep hands the workers: seed 0 finished, seed 1's running mean still to run."""
    cfg = tiny_config(tmp_path / "data", **{"model.path": str(tiny_model_dir), "experiment.arms": ARMS,
                                            "experiment.results_dir": str(tmp_path / "results"), "experiment.seeds": 2,
                                            "experiment.driver": "inprocess", "serving.torch_threads": 1,
                                            **scenario(**{"experiment.pretrain_rollouts": 6})})
    first, second = seed_runs(cfg)
    write_scenario(results_dir(second), second.experiment)  # as simulate does before the runs
    lines = []
    run_arms_inprocess([(first, []), (second, ["rm"])], style_classifier, 2, pretrains, lines.append)
    assert not results_dir(first).exists()
    assert [p.name for p in sorted(results_dir(second).glob("rm*"))] == ["rm.jsonl", "rm.summary.json"]
    assert not (results_dir(second) / "arms" / "pretrain-data").exists()  # a running mean needs no critic data
    assert lines[0].startswith("1 runs over 1 seed(s), 2 at a time")
    assert lines[-1] == "=== 1/1 runs done ([seed 2/2 rm]) ==="


@pytest.mark.parametrize("signum, code, said", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                (signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGKILL, -signal.SIGKILL, None)])
def test_a_signal_to_the_sweep_stops_its_workers_and_no_run_writes_after_it(tmp_path, signum, code, said):
    """SIGTERM to ``simulate --jobs N`` (an operator's kill) ended the parent alone: its workers ran
    on as orphans appending to the results, beside the ``--resume`` that the operator started next.
    Ctrl-C (SIGINT to the whole process group, as a terminal sends it) left the parent waiting for
    the runs under way. Both now stop the workers at once and end with the resume hint; a SIGKILL,
    which the parent cannot act on, ends the workers through their parent death signal."""
    with (tmp_path / "out").open("wb") as out, (tmp_path / "err").open("wb") as err:
        # a session of its own: its Ctrl-C reaches the sweep's process group, not pytest's
        parent = subprocess.Popen([sys.executable, "-c", sweep_jobs.PARENT, str(tmp_path)], cwd=REPO,
                                  preexec_fn=with_terminal_sigint,
                                  stdout=out, stderr=err, start_new_session=True)
    workers: list[int] = []
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("started-*"))) == 2, STARTED_TIMEOUT_S), \
            (tmp_path / "err").read_text()
        workers = [int(p.read_text()) for p in tmp_path.glob("started-*")]
        if signum == signal.SIGINT:
            os.killpg(parent.pid, signum)
        else:
            parent.send_signal(signum)
        returned = parent.wait(STOPPED_TIMEOUT_S)
        (tmp_path / "go").touch()  # a worker still running would write its result now
        assert wait_until(lambda: all(gone(pid) for pid in workers), STOPPED_TIMEOUT_S), "a worker outlived the sweep"
        assert not (tmp_path / "results.jsonl").exists()
        assert sorted(p.name for p in tmp_path.glob("started-*")) == ["started-a", "started-b"]  # the rest cancelled
        assert returned == code
        if said is not None:
            assert (tmp_path / "err").read_text().strip().splitlines()[-1] == \
                f"online-sao: {said}; the runs that finished are kept: the same command with --resume runs the rest"
    finally:
        kill_leftovers(parent, workers)
