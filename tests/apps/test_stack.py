"""The stack of processes an experiment or the smoke run starts: a SIGTERM or SIGHUP to the parent stops
them, and they die with a parent killed outright."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from apps import stack as stack_module
from apps.config import load_app_config
from apps.stack import Component, Stack
from tests.fixtures.processes import gone, kill_leftovers, wait_until, with_terminal_sigint
from online_sao.config import dump_config


REPO = Path(__file__).resolve().parents[2]
CHILD_S = 120
"""How long a test's child sleeps at most: one a failing test leaves behind still ends."""
WAIT_S = 60.0
"""Bound on a child's or the parent's start, and on a stopped one's end."""
DEAF = f"""
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: Path(sys.argv[1] + ".sigterm").touch())
Path(sys.argv[1] + ".ready").touch()
time.sleep({CHILD_S})
"""
"""``python -c DEAF PATH``: a child that notes a SIGTERM (PATH.sigterm) and goes on, as a process
with a slow shutdown does; PATH.ready once it listens."""
PARENT = f"""
import sys, time
from pathlib import Path
import apps.stack as st

where = Path(sys.argv[1])
st.Stack._cli_args = lambda self, extra=None: [sys.executable, "-c"]
with st.Stack(None, {{}}, where / "run", progress=lambda line: None) as stack:
    quick = stack.start("quick", ["import time; time.sleep({CHILD_S})"])
    slow = stack.start("slow", [sys.argv[2], str(where / "slow")])
    (where / "pids").write_text(f"{{quick.process.pid}} {{slow.process.pid}}")
    while True:
        stack.check_alive()
        time.sleep(0.1)
"""
"""``python -c PARENT WHERE DEAF``: a stack of a quick child and a slow one (DEAF), as ``demo`` or a
live ``simulate`` holds serving, learner and judge, until an interrupt."""


def test_a_second_ctrl_c_during_a_slow_shutdown_leaves_no_child_running(tmp_path):
    """Ctrl-C, then Ctrl-C again while a child takes its time to stop: the second one raised inside
    the wait for that child and abandoned it and every child after it (serving kept its port and
    spool lock). Every child now has its SIGTERM at once, and the second interrupt kills the rest."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), DEAF], cwd=REPO,
                              preexec_fn=with_terminal_sigint, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    children: list[int] = []
    try:
        assert wait_until(lambda: (tmp_path / "pids").exists() and (tmp_path / "slow.ready").exists(), WAIT_S)
        children = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
        parent.send_signal(signal.SIGINT)
        assert wait_until(lambda: (tmp_path / "slow.sigterm").exists(), WAIT_S)  # stop_all is waiting for it
        parent.send_signal(signal.SIGINT)
        parent.wait(stack_module.STOP_TIMEOUT_S / 2)  # not the stop timeout: the second Ctrl-C cut it short
        assert wait_until(lambda: all(gone(pid) for pid in children), 5.0), \
            f"left running: {[pid for pid in children if not gone(pid)]}"
    finally:
        kill_leftovers(parent, children)


def test_stop_all_signals_every_child_first_and_waits_for_them_together(tmp_path, monkeypatch):
    """Three children that take their time (ignore SIGTERM) stop in about one STOP_TIMEOUT_S, not
    three: each got its SIGTERM before the first was waited on, and the slow ones were killed."""
    monkeypatch.setattr(stack_module, "STOP_TIMEOUT_S", 2.0)
    monkeypatch.setattr(Stack, "_cli_args", lambda self, extra=None: [sys.executable, "-c"])
    stack = Stack(None, {}, tmp_path / "run", progress=lambda line: None)
    children = [stack.start(f"deaf{i}", [DEAF, str(tmp_path / f"deaf{i}")]) for i in range(3)]
    assert wait_until(lambda: all((tmp_path / f"deaf{i}.ready").exists() for i in range(3)), WAIT_S)
    started = time.monotonic()
    stack.stop_all()
    took = time.monotonic() - started
    assert all((tmp_path / f"deaf{i}.sigterm").exists() for i in range(3))
    assert all(child.process.returncode == -signal.SIGKILL for child in children)
    assert stack.components == []
    assert took < 2 * stack_module.STOP_TIMEOUT_S, f"stopped in {took:.1f} s"


@pytest.mark.parametrize("already_running", [True, False])
def test_a_run_stops_the_broker_it_started_and_leaves_one_it_found_running(tmp_path, monkeypatch, already_running):
    """`smoke`, `simulate`, `load` and `agent` next to a broker the operator started with `kafka up`."""
    stopped = []

    class Broker:
        log_file = tmp_path / "kafka.log"

        def __init__(self, cfg, stop_with_parent):
            pass

        def start(self):
            return not already_running

        def stop(self):
            stopped.append(True)

    class Backend:
        def __init__(self, cfg):
            pass

        def ensure_topics(self):
            pass

    monkeypatch.setattr("streams.broker.LocalBroker", Broker)
    monkeypatch.setattr("streams.kafka_backend.KafkaBackend", Backend)
    with Stack(None, {"paths.data_dir": str(tmp_path)}, tmp_path, progress=lambda line: None) as stack:
        stack.start_broker()
    assert stopped == ([] if already_running else [True])


@pytest.mark.parametrize("resolved", [True, False])
def test_children_of_a_resolved_config_do_not_read_the_environment_again(tmp_path, monkeypatch, resolved):
    """The agent and simulate hand their children a resolved dump with a free port of their own;
    ONLINE_SAO__SERVING__PORT left in the environment (the README's own example) moved the children's
    server to 8001 while the parent waited on the free port. A stack on the operator's own file
    (smoke, load) still takes the environment, as the parent did."""
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(load_app_config(environ={}, overrides={"serving.port": 45678}), reveal_secrets=True))
    monkeypatch.setenv("ONLINE_SAO__SERVING__PORT", "8001")
    with Stack(path, {}, tmp_path / "run", progress=lambda _: None, resolved=resolved) as stack:
        child = stack.start("show", ["config", "show"])
        assert child.process.wait(60) == 0
        shown = yaml.safe_load(child.log_path.read_text())
        expected = 45678 if resolved else 8001
        assert shown["serving"]["port"] == expected and stack.cfg.serving.port == expected


def test_overrides_reach_the_children_as_the_parent_read_them(tmp_path):
    """A string went to the child as YAML ('2024-01-01' with its quotes), and the child now takes a
    text field's --set value as written: the quotes became part of the deployment id."""
    overrides = {"serving.deployment_id": "2024-01-01", "kafka.sasl_password": "p@ss #1", "serving.port": 8123,
                 "serving.api_keys": ["k1", "k 2"]}
    stack = Stack(None, overrides, tmp_path / "run", progress=lambda _: None)
    child = stack.start("show", ["config", "show"])
    assert child.process.wait(60) == 0
    shown = yaml.safe_load(child.log_path.read_text())
    assert shown["serving"]["deployment_id"] == "2024-01-01" and shown["serving"]["port"] == 8123
    assert stack.cfg.kafka.sasl_password.get_secret_value() == "p@ss #1"
    assert len(shown["serving"]["api_keys"]) == 2


def _hangup_at_default() -> None:
    """preexec_fn: SIGHUP at its default in the test's parent, also when pytest runs under nohup."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_children_do_not_outlive_a_parent_killed_or_hung_up(tmp_path, sig):
    """A stack's parent killed (OOM killer, kill -9) or hung up (terminal closed, ssh dropped): its
    children, in sessions of their own, ran on, serving holding its port and spool lock. They now get
    their parent death signal, and a SIGHUP unwinds the parent as a SIGTERM does (exit 128 + 1)."""
    quick = f"import time; time.sleep({CHILD_S})"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), quick], cwd=REPO,
                              preexec_fn=_hangup_at_default, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    children: list[int] = []
    try:
        assert wait_until(lambda: (tmp_path / "pids").exists(), WAIT_S)
        children = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
        parent.send_signal(sig)
        parent.wait(WAIT_S)
        assert parent.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGHUP)
        assert wait_until(lambda: all(gone(pid) for pid in children), 10.0), \
            f"left running: {[pid for pid in children if not gone(pid)]}"
    finally:
        kill_leftovers(parent, children)


class OutsideHandler(Exception):
    """Raised by the handler a test installs before the stack: the signal was not the stack's."""


def _outside_handler(signum: int, frame: object) -> None:
    raise OutsideHandler(signum)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_inside_the_stack_stops_its_processes_and_restores_the_handler(tmp_path, sig):
    """SIGHUP (the terminal closed) ended the process at once, as SIGTERM did before it was handled."""
    before = {s: signal.signal(s, _outside_handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(SystemExit) as exited:
            with Stack(None, {}, tmp_path) as stack:
                stack.components.append(Component("sleeper", child, tmp_path / "sleeper.log"))
                os.kill(os.getpid(), sig)
        assert exited.value.code == 128 + sig
        assert child.poll() is not None  # terminated by stop_all, not left running
        assert all(signal.getsignal(s) is _outside_handler for s in before)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_hangup_ignored_before_the_stack_stays_ignored(tmp_path):
    """Under nohup the operator asked the run to outlive the terminal: the stack leaves SIGHUP ignored."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Stack(None, {}, tmp_path):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing happens
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_children_are_started_only_from_the_thread_that_created_the_stack(tmp_path, monkeypatch):
    """The parent death signal follows the thread that forked the child: a child started from a thread
    that then ends got SIGTERM at once, though the stack and its process went on."""
    import threading

    monkeypatch.setattr(Stack, "_cli_args", lambda self, extra=None: [sys.executable, "-c"])
    stack = Stack(None, {}, tmp_path / "run", progress=lambda line: None)
    raised: list[BaseException] = []

    def start_elsewhere() -> None:
        try:
            stack.start("elsewhere", [f"import time; time.sleep({CHILD_S})"])
        except RuntimeError as exc:
            raised.append(exc)

    worker = threading.Thread(target=start_elsewhere)
    worker.start()
    worker.join()
    try:
        assert raised and "thread that created it" in str(raised[0]) and stack.components == []
    finally:
        stack.stop_all()


def test_own_state_overrides_name_every_piece_of_state_after_the_run(tmp_path):
    """What smoke and load run on beside the deployment: one helper, so neither forgets a piece (both
    forgot MLflow: their learners registered into the deployment's registered model)."""
    from online_sao.config import TopicsConfig

    deployment = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data"),
                                                        "mlflow.tracking_uri": "http://mlflow:5000"})
    run_dir = tmp_path / "runs" / "r-1"
    overrides = stack_module.own_state_overrides(deployment, "r-1", run_dir)
    run = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data"),
                                                 "mlflow.tracking_uri": "http://mlflow:5000", **overrides})

    assert {getattr(run.kafka.topics, role) for role in TopicsConfig.model_fields} == {
        f"{getattr(deployment.kafka.topics, role)}.r-1" for role in TopicsConfig.model_fields}
    assert run.trainer.consumer_group == f"{deployment.trainer.consumer_group}.r-1"  # a prefix grant covers it
    assert (run.weight_store_url, run.checkpoint_dir, run.spool_dir) == (
        str(run_dir / "weights"), run_dir / "checkpoints", run_dir / "spool")
    assert (run.mlflow.experiment, run.mlflow.registered_model) == ("online-sao.r-1", "online-sao-policy.r-1")
    assert run.mlflow_uri == "http://mlflow:5000"
    assert "trainer.metrics_port" not in overrides  # off in the deployment: off in the run


def test_runs_started_in_the_same_second_get_ids_and_directories_of_their_own(tmp_path, monkeypatch):
    """Smoke's and load's run id names their topics, consumer group, ledger and MLflow experiment: two
    runs in one second shared all of them, on one data directory or on two against one cluster."""
    monkeypatch.setattr(stack_module.time, "gmtime", lambda: time.struct_time((2026, 12, 7, 9, 5, 3, 0, 341, 0)))
    draws = iter(["0a0a", "0a0a", "1b1b", "2c2c"])  # the second draw repeats the first: drawn again
    monkeypatch.setattr(stack_module.secrets, "token_hex", lambda nbytes: next(draws))

    first = stack_module.new_run(tmp_path / "runs", "smoke")
    second = stack_module.new_run(tmp_path / "runs", "smoke")
    elsewhere = stack_module.new_run(tmp_path / "other-host" / "runs", "smoke")

    assert [run_id for run_id, _ in (first, second, elsewhere)] == [
        "smoke-20261207-090503-0a0a", "smoke-20261207-090503-1b1b", "smoke-20261207-090503-2c2c"]
    assert all(run_dir.name == run_id and run_dir.is_dir() for run_id, run_dir in (first, second, elsewhere))


def test_a_private_file_left_readable_by_an_earlier_run_is_made_private_again(tmp_path):
    """The run's config holds secrets; O_CREAT's mode applied to a new file only, so a config left 0644
    (by hand, or by an older build) stayed readable by others when rewritten."""
    path = tmp_path / "config.yaml"
    path.write_text("old")
    path.chmod(0o644)

    stack_module.write_private(path, "kafka:\n  sasl_password: secret\n")

    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text().endswith("secret\n")
