"""The command line: shortcuts for settings, and how a run that cannot go on or is interrupted ends."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from apps import cli, commands
from online_sao import log_setup

DRIFT_SHORT = Path(__file__).resolve().parents[2] / "configs" / "drift-short.yaml"


def test_the_resume_flag_sets_the_configured_resume():
    args = cli.build_parser().parse_args(["simulate", "--resume"])
    assert commands.overrides(args) == {"experiment.resume": True}
    assert commands.overrides(cli.build_parser().parse_args(["simulate"])) == {}
    assert commands.overrides(cli.build_parser().parse_args(["lr-sweep", "--rates", "1e-4", "--resume"])) == {
        "experiment.resume": True}


def test_an_unknown_arm_is_a_one_line_error_with_the_scenarios_arms(tmp_path, capsys):
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "simulate", "--scenario", str(DRIFT_SHORT),
                     "--arm", "running_mean_w8"]) == 2
    err = capsys.readouterr().err
    assert err == ("online-sao: unknown arm(s) ['running_mean_w8']; the scenario has ['sao', 'running_mean_w128', "
                   "'grpo_dis_g4']\n")
    assert not (tmp_path / "experiments").exists()  # stopped before writing anything


def test_an_interrupted_sweep_says_how_to_go_on_and_other_errors_propagate(tmp_path, monkeypatch, capsys):
    from apps.experiments import orchestrate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(orchestrate, "run_simulation", interrupted)
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "simulate"]) == 130
    assert "the same command with --resume runs the rest" in capsys.readouterr().err

    def fails(*args, **kwargs):
        raise RuntimeError("a run failed")

    monkeypatch.setattr(orchestrate, "run_simulation", fails)
    with pytest.raises(RuntimeError, match="a run failed"):
        cli.main(["--set", f"paths.data_dir={tmp_path}", "simulate"])


def test_a_terminated_sweep_says_how_to_go_on_with_143_and_puts_the_handler_back(tmp_path, monkeypatch, capsys):
    """SIGTERM (an operator's kill, a CI timeout) ended an in-process sweep on the spot, silently and
    with its side-by-side workers left running; it now unwinds as Ctrl-C does (the workers stopped:
    tests/apps/experiments/test_parallel.py) and says how to go on."""
    import os
    import signal

    from apps.experiments import orchestrate

    def not_handled(signum, frame):  # where the sweep does not take SIGTERM, this test fails, not pytest
        raise AssertionError("SIGTERM reached the handler the sweep found")

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(orchestrate, "run_simulation", terminated)
    before = signal.signal(signal.SIGTERM, not_handled)
    try:
        assert cli.main(["--set", f"paths.data_dir={tmp_path}", "simulate"]) == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is not_handled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.strip().splitlines() == [
        "online-sao: terminated (SIGTERM); the runs that finished are kept: the same command with --resume runs the rest"]


def test_a_report_without_results_says_where_it_looked(tmp_path, capsys):
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "report"]) == 1
    assert capsys.readouterr().err.startswith(
        f"online-sao: no experiment results in {tmp_path / 'experiments' / 'drift'}: it does not exist\n"
        "(`online-sao simulate` writes results")
    (tmp_path / "experiments" / "drift").mkdir(parents=True)
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "report"]) == 1
    assert "drift: no scenario.json there or in a seed-<k>/ in it\n" in capsys.readouterr().err
    (tmp_path / "experiments" / "drift" / "scenario.json").write_text("{}")  # a run that wrote no arm's results
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "report"]) == 1
    assert "no per-arm results (*.jsonl) in" in capsys.readouterr().err


def test_a_model_path_without_a_model_is_a_one_line_error(tmp_path, capsys):
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "--set", f"model.path={tmp_path / 'none'}",
                     "base-model"]) == 2
    assert capsys.readouterr().err == f"online-sao: model.path {tmp_path / 'none'} holds no Hugging Face model (no config.json)\n"


def test_the_committed_configuration_reference_is_what_the_command_prints(monkeypatch, capsys):
    for name in [n for n in os.environ if n.startswith("ONLINE_SAO__")]:
        monkeypatch.delenv(name)
    assert cli.main(["config", "reference"]) == 0
    printed = capsys.readouterr().out
    committed = (Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md").read_text()
    assert printed == committed, "docs/CONFIG.md is stale: run `online-sao config reference > docs/CONFIG.md`"
    assert "- **`serving.kv_layout`**" in printed and "- **`experiment.arms[].name`**" in printed


def test_config_and_set_work_after_the_subcommand_too(capsys):
    """The docs' `online-sao agent --config configs/agent.yaml` form, beside the `online-sao --config ... agent` one."""
    local = str(DRIFT_SHORT.parent / "local.yaml")
    assert cli.main(["--set", "serving.port=8101", "config", "show", "--config", local,
                     "--set", "trainer.max_wait_s=0.25"]) == 0
    shown = capsys.readouterr().out
    assert "port: 8101" in shown and "max_wait_s: 0.25" in shown
    assert cli.main(["--config", local, "config", "show", "--config", str(DRIFT_SHORT)]) == 2
    assert "give --config once" in capsys.readouterr().err


def test_a_set_value_that_is_not_yaml_is_one_line_and_exit_2(capsys):
    assert cli.main(["--set", "serving.port=[", "config", "show"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("online-sao: --set serving.port: not a YAML value")


def test_a_set_text_field_is_taken_as_written_and_a_bad_value_never_echoed(capsys):
    """As for the environment: YAML cut a password at " #" and quoted a bad value (a secret) back."""
    assert cli.main(["--set", "kafka.sasl_password=p@ss #1", "--set", "serving.deployment_id=2024-01-01",
                     "config", "show"]) == 0
    assert "deployment_id: '2024-01-01'" in capsys.readouterr().out
    args = cli.build_parser().parse_args(["--set", "kafka.sasl_password=p@ss #1", "config", "show"])
    assert commands.overrides(args)["kafka.sasl_password"] == "p@ss #1"
    assert cli.main(["--set", "serving.api_keys=[!s3cret, x", "config", "show"]) == 2
    assert "s3cret" not in capsys.readouterr().err


def test_the_outside_world_failing_is_one_line_and_exit_1_and_an_interrupt_130(monkeypatch, capsys):
    from streams.base import StreamUnavailable

    def unreachable(cfg, args):
        raise StreamUnavailable("creating a producer: Kafka at 127.0.0.1:1 not reachable")

    def interrupted(cfg, args):
        raise KeyboardInterrupt

    for run, code, line in ((unreachable, 1, "online-sao: creating a producer: Kafka at 127.0.0.1:1 not reachable"),
                            (interrupted, 130, "online-sao: interrupted")):
        monkeypatch.setattr(commands, "config", run)
        assert cli.main(["config", "show"]) == code
        assert capsys.readouterr().err.strip().splitlines() == [line]


def test_a_full_disk_is_one_line_naming_the_file_and_exit_1_and_other_os_errors_propagate(monkeypatch, capsys):
    def full(cfg, args):
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/.tmp-1/optim.safetensors")

    monkeypatch.setattr(commands, "config", full)
    assert cli.main(["config", "show"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "online-sao: [Errno 28] No space left on device: '/ckpt/.tmp-1/optim.safetensors'"]

    def disk_error(cfg, args):  # MLflow's SQLite store: "disk I/O error", which a full quota reads as
        raise OSError(errno.EIO, "Input/output error (MLflow's store: disk I/O error)")

    monkeypatch.setattr(commands, "config", disk_error)
    assert cli.main(["config", "show"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "online-sao: [Errno 5] Input/output error (MLflow's store: disk I/O error)"]

    def broken_pipe(cfg, args):  # not the operator's to fix by making room: a traceback, as before
        raise OSError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(commands, "config", broken_pipe)
    with pytest.raises(OSError, match="Broken pipe"):
        cli.main(["config", "show"])


def test_serving_exposed_without_keys_is_one_line_and_exit_2(capsys):
    assert cli.main(["--set", "serving.host=0.0.0.0", "serve"]) == 2
    assert "serving.api_keys is empty" in capsys.readouterr().err


def test_serving_exposed_with_the_built_in_feedback_secret_is_one_line_and_exit_2(capsys):
    assert cli.main(["--set", "serving.host=0.0.0.0", "--set", "serving.api_keys=[sk-mine]", "serve"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serving.feedback_secret is a placeholder" in err[0]


def test_learn_with_a_pretrain_file_that_is_not_there_is_one_line_before_anything_connects(tmp_path, tiny_model_dir,
                                                                                            capsys):
    missing = tmp_path / "logged.jsonl"
    assert cli.main(["--set", f"model.path={tiny_model_dir}", "--set", f"trainer.pretrain_file={missing}",
                     "--set", "kafka.bootstrap_servers=127.0.0.1:1", "learn", "--pretrain-critic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"online-sao: trainer.pretrain_file {missing} is not a file: learn --pretrain-critic reads its "
                   "logged rollouts there (unset it to read the topics' retained history)"]


@pytest.mark.parametrize(("argv", "says"), [
    (["load", "--clients", "0"], "--clients: must be above 0, got 0"),
    (["load", "--duration-s", "-5"], "--duration-s: must be above 0, got -5"),
    (["load", "--stream-share", "1.5"], "--stream-share: must lie in [0, 1], got 1.5"),
    (["load", "--out", "run.png"], "--out: names the results JSON (its plot goes beside it as .png), got run.png"),
    (["lr-sweep", "--rates", "1e-4,abc"], "--rates: expected comma-separated numbers, got '1e-4,abc'"),
    (["lr-sweep", "--rates", "1e-4,nan"], "--rates: expected positive finite learning rates, got '1e-4,nan'"),
    (["lr-sweep", "--rates", "inf"], "--rates: expected positive finite learning rates, got 'inf'"),
    (["load", "--out", "."], "--out: names the results file, not a directory: . is one (e.g. load.json)"),
    (["load", "--duration-s", "inf"], "--duration-s: must be finite, got inf"),  # ran on, then wrote Infinity
    (["load", "--duration-s", "nan"], "--duration-s: must be above 0, got nan"),
    (["weights", "hold", "-5"], "argument VERSION: versions are numbered from 0, got -5"),  # said "compacted"
], ids=["clients", "duration", "share", "plot-as-out", "rates", "nan-rate", "inf-rate", "directory-as-out",
        "inf-duration", "nan-duration", "negative-version"])
def test_an_argument_out_of_its_range_is_a_usage_error(capsys, argv, says):
    with pytest.raises(SystemExit) as usage:
        cli.main(argv)
    assert usage.value.code == 2 and says in capsys.readouterr().err


def test_ledger_redact_overwrites_the_ids_and_says_how_many(tmp_path, capsys):
    from trainer.checkpoint import read_ledger

    ledger = tmp_path / "checkpoints" / "ledger.jsonl"
    ledger.parent.mkdir()
    ledger.write_text('{"step":1,"ids":["sao-1","sao-2"]}\n')
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "ledger", "redact", "sao-2", "sao-9"]) == 0
    assert "1 occurrence(s) of 2 id(s) redacted" in capsys.readouterr().out
    assert read_ledger(tmp_path / "checkpoints") == [(1, "sao-1"), (1, "-----")]


def test_ledger_redact_covers_every_segment_and_sealed_lists_the_old_ones(tmp_path, capsys):
    """The ledger is segment files: redaction reaches all of them, and ``sealed`` names those the
    learner no longer reads (the ones an operator may archive or delete)."""
    from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState, read_ledger

    checkpointer = Checkpointer(tmp_path / "checkpoints", ledger_segment_bytes=1)  # a segment per checkpoint
    for step in (1, 2, 3):
        checkpointer.record_trained(step, [f"sao-{step}", "sao-x"])
        checkpointer.save(Checkpoint(LearnerState(step=step, version=0, offsets={}, joiner={}), {}, {}))
    argv = ["--set", f"paths.data_dir={tmp_path}", "ledger"]
    assert cli.main([*argv, "redact", "sao-x"]) == 0
    assert "3 occurrence(s) of 1 id(s) redacted in 3 ledger file(s)" in capsys.readouterr().out
    assert [iid for _, iid in read_ledger(tmp_path / "checkpoints")] == ["sao-1", "-----", "sao-2", "-----",
                                                                         "sao-3", "-----"]
    assert cli.main([*argv, "sealed"]) == 0
    segments = tmp_path / "checkpoints" / "ledger"
    assert capsys.readouterr().out.split() == [str(segments / "00000001.jsonl"), str(segments / "00000002.jsonl")]


def test_ledger_redact_leaves_a_torn_last_line_and_says_so(tmp_path, capsys):
    """A learner stopped mid-append (a full disk) leaves a torn last line, which its next start cuts:
    redaction failed on it with a bare JSONDecodeError and erased nothing."""
    segment = tmp_path / "checkpoints" / "ledger" / "00000001.jsonl"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(b'{"step":1,"ids":["sao-1","sao-2"]}\n{"step":2,"ids":["sao-2","sao')
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "ledger", "redact", "sao-2"]) == 0
    out, err = capsys.readouterr()
    assert "1 occurrence(s) of 1 id(s) redacted" in out
    assert f"{segment} ends in a torn line" in err and "the learner's next start cuts it" in err
    assert segment.read_bytes() == b'{"step":1,"ids":["sao-1","-----"]}\n{"step":2,"ids":["sao-2","sao'


def test_ledger_sealed_without_checkpoints_says_so_and_creates_nothing(tmp_path, capsys):
    argv = ["--set", f"paths.data_dir={tmp_path}", "ledger", "sealed"]
    assert cli.main(argv) == 1
    assert "no checkpoints in" in capsys.readouterr().err and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("argv", "runner", "key"), [
    (["--set", "experiment.max_tokens=300", "simulate", "--driver", "inprocess"],
     "apps.experiments.orchestrate.run_simulation", "experiment.max_tokens = 300"),
    (["--set", "experiment.max_tokens=300", "lr-sweep", "--rates", "1e-4"], "apps.experiments.sweep.run_lr_sweep",
     "experiment.max_tokens = 300"),
    (["--set", "agent.max_tokens=40", "--set", "serving.max_new_tokens=32", "agent"], "apps.agent.run.run_agent",
     "agent.max_tokens = 40"),
], ids=["simulate", "lr-sweep", "agent"])
def test_requests_above_what_serving_grants_stop_the_run_before_it_starts(monkeypatch, capsys, argv, runner, key):
    """Serving refuses every request above serving.max_new_tokens: the run did all its setup, then the
    in-process driver died on its first request with a traceback."""
    started = []
    monkeypatch.setattr(runner, lambda *args, **kwargs: started.append(args) or "")
    assert cli.main(argv) == 2 and not started
    assert capsys.readouterr().err == (f"online-sao: {key} is above serving.max_new_tokens = "
                                       f"{256 if 'experiment' in key else 32}, the most a request may ask for: "
                                       "lower the one or raise the other\n")


def test_a_serving_limit_below_the_scenarios_defaults_still_serves(capsys):
    """Only the commands that send the scenarios' requests check them: serving alone with a small limit
    (the fault harness's 16) is a valid configuration."""
    assert cli.main(["--set", "serving.max_new_tokens=16", "config", "show"]) == 0
    assert "max_new_tokens: 16" in capsys.readouterr().out


def test_ledger_redact_of_ids_the_ledger_lacks_fails(tmp_path, capsys):
    """An erasure request that erased nothing (a mistyped id, another data_dir) exited 0."""
    ledger = tmp_path / "checkpoints" / "ledger.jsonl"
    ledger.parent.mkdir()
    ledger.write_text('{"step":1,"ids":["sao-1","sao-2"]}\n')
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "ledger", "redact", "sao-9"]) == 1
    out, err = capsys.readouterr()
    assert "0 occurrence(s) of 1 id(s) redacted" in out and "none of the ids is in the ledger" in err
    assert ledger.read_text() == '{"step":1,"ids":["sao-1","sao-2"]}\n'


@pytest.mark.parametrize(("settings", "line"), [
    (["serving.feedback_sources=[user]"], "serving.feedback_sources (['user']) does not allow 'agent', the source of "
     "the agent's rewards: serving would refuse every one (403); add it"),
    (["serving.api_keys=[key-one, key-two]", "serving.source_keys={agent: [key-two]}"],
     "serving.source_keys.agent does not hold the key the agent sends (the first of serving.api_keys): serving would "
     "refuse every reward of the agent (403); add it there"),
    (["reward.sources=[user]"], "reward.sources (['user']) does not include 'agent', the source of the agent's "
     "rewards: the learner would ignore every one and train on nothing; add it"),
    (["reward.min_value=-1", "reward.max_value=0.5", "reward.default_value=0"],
     "reward.min_value..max_value (-1..0.5) leaves out the agent's reward 1: serving would refuse it (422); "
     "widen the range"),
], ids=["feedback_sources", "source_keys", "reward.sources", "reward range"])
def test_an_agent_whose_rewards_would_be_refused_or_ignored_stops_before_it_starts(monkeypatch, capsys, settings,
                                                                                   line):
    """Serving refused every reward (the run died after its setup with a traceback), or the learner
    ignored every one (the run ended with nothing trained and no word why)."""
    started = []
    monkeypatch.setattr("apps.agent.run.run_agent", lambda *args, **kwargs: started.append(args) or "")
    argv = [arg for setting in settings for arg in ("--set", setting)]
    assert cli.main(argv + ["agent"]) == 2 and not started
    assert capsys.readouterr().err == f"online-sao: {line}\n"


@pytest.mark.parametrize("settings", [
    [], ["serving.feedback_sources=[user, agent]", "reward.sources=[user, agent]"],
    ["serving.api_keys=[key-one, key-two]", "serving.source_keys={agent: [key-one]}"],
], ids=["defaults", "listed", "the agent's key"])
def test_an_agent_whose_rewards_are_taken_starts(monkeypatch, settings):
    started = []
    monkeypatch.setattr("apps.agent.run.run_agent", lambda *args, **kwargs: started.append(args) or "")
    assert cli.main([arg for setting in settings for arg in ("--set", setting)] + ["agent"]) == 0 and started


def _agent_fails_in_one_line(monkeypatch, capsys, error: Exception) -> None:
    def failing(cfg, progress=print):
        raise error
    monkeypatch.setattr("apps.agent.run.run_agent", failing)
    assert cli.main(["agent"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"online-sao: {error}"]


def test_a_refused_reward_ends_the_agent_in_one_line(monkeypatch, capsys):
    from apps.agent.episode import FeedbackRefused

    _agent_fails_in_one_line(monkeypatch, capsys, FeedbackRefused("the reward for x was refused: 403 nope"))


def test_tasks_failing_in_a_row_end_the_agent_in_one_line(monkeypatch, capsys):
    from apps.agent import run

    _agent_fails_in_one_line(monkeypatch, capsys, run.TasksFailing("10 tasks failed in a row; see the serving log"))


def test_serve_logs_info_lines_with_time_and_level(monkeypatch, tmp_path):
    """`online-sao serve` set no logging up: "ready after", "spool replayed", "serving stopped" never
    showed, and its warnings came out without time or level."""
    import logging
    from contextlib import nullcontext

    root, kafka = logging.getLogger(), logging.getLogger("kafka")
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh process (pytest's capture handlers put aside)
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.setattr(kafka, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("httpx"), "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("httpcore"), "level", logging.NOTSET)  # set back after the test
    served = []
    monkeypatch.setattr("apps.default_model.builder.build_base_model", lambda cfg, progress: tmp_path)
    monkeypatch.setattr("serving.spool_lock.exclusive_spool", lambda path: nullcontext())
    monkeypatch.setattr("serving.server.run_server", lambda cfg, model_dir: served.append(model_dir) or 0)
    assert cli.main(["--set", f"paths.data_dir={tmp_path}", "serve"]) == 0 and served == [tmp_path]
    assert root.level == logging.INFO and logging.getLogger("serving.server").isEnabledFor(logging.INFO)
    assert [handler.formatter._fmt for handler in root.handlers] == [log_setup.LOG_FORMAT]
    assert "%(asctime)s %(levelname)s" in log_setup.LOG_FORMAT
    assert kafka.level == logging.WARNING  # kafka-python's connection chatter stays out
    assert logging.getLogger("httpx").level == logging.WARNING  # its INFO lines name URLs, passwords in them


@pytest.mark.parametrize("text, version", [("3", 3), ("v3", 3), ("0", 0)])
def test_weights_hold_takes_a_version_as_weights_status_writes_it(text, version):
    """`weights status` lists "can be held: v1, v2, v3"; `weights hold v3` was a usage error."""
    assert cli.build_parser().parse_args(["weights", "hold", text]).version == version


def test_a_judge_started_alone_refuses_raters_outside_the_reward_range(tmp_path, capsys):
    """`online-sao judge` runs beside an experiment's arms without run_simulation, whose check it skipped:
    the learner then dead-lettered the generous topic's good answers' rewards."""
    argv = ["--set", f"paths.data_dir={tmp_path}", "--set", "reward.min_value=0", "--set", "reward.max_value=1",
            "--set", "experiment.rater_scale={cooking: 1.5}", "judge"]
    assert cli.main(argv) == 2
    assert "raters of topic 'cooking' give rewards in [0, 1.5]" in capsys.readouterr().err
