"""Starting the local broker, against a stand-in JVM (no Kafka jars, a few seconds per test).

The stand-in formats as Kafka's StorageTool does and, as ``kafka.Kafka``, takes its log directory's
lock and binds its port after a JVM-like start-up, exiting 1 when another broker holds them, as
Kafka does. It speaks no Kafka protocol: readiness here is its port accepting connections.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import streams.broker
from streams.broker import BrokerError, LocalBroker
from tests.fixtures.kafka import local_broker_config

REPO = Path(streams.broker.__file__).resolve().parents[1]
START_WAIT_S = 60.0
"""Longest a start may take here: the stand-in's start-up is 1 s, the rest is a loaded 2-core box."""
FORK_TO_PRCTL_WINDOW_S = 1.0
"""The gap between the fork and the parent death signal, widened from microseconds so that the
parent surely dies inside it."""
PARENT_DEATH_WAIT_S = 10.0
"""How long the broker may take to go once its parent died in that window."""
STOP_CHANCE_S = 3.0
"""How long a start waits, after its pid check, for a stop that does not wait for it to return."""

_STAND_IN_JVM = '''
import fcntl, os, signal, socket, sys, time
args = sys.argv[1:]
def properties(path):
    return dict(line.split("=", 1) for line in open(path).read().splitlines() if "=" in line)
if "kafka.tools.StorageTool" in args:
    log_dirs = properties(args[args.index("-c") + 1])["log.dirs"]
    os.makedirs(log_dirs, exist_ok=True)
    open(os.path.join(log_dirs, "meta.properties"), "w").write("cluster.id=stand-in\\n")
    sys.exit(0)
props = properties(args[-1])
time.sleep(1.0)  # the JVM's start-up
lock = open(os.path.join(props["log.dirs"], ".lock"), "w")
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print("Failed to acquire lock on file .lock", flush=True)
    sys.exit(1)
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(props["listeners"].split(",")[0].rsplit(":", 1)[1])))
listener.listen()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(1)
'''

_STARTER = '''
import os, subprocess, sys, time
from pathlib import Path
from apps.config import load_app_config
from streams.broker import LocalBroker
data_dir, port, controller_port, lib_dir, pid_note, window_s = sys.argv[1:]
real_popen = subprocess.Popen

def widened_popen(*args, preexec_fn=None, **kwargs):
    """The broker's Popen, with its preexec_fn run only after a pause: the parent dies in it."""
    if preexec_fn is None:
        return real_popen(*args, **kwargs)
    set_up = preexec_fn

    def late_set_up():
        Path(pid_note + ".part").write_text(str(os.getpid()))
        os.rename(pid_note + ".part", pid_note)
        time.sleep(float(window_s))
        set_up()
    return real_popen(*args, preexec_fn=late_set_up, **kwargs)

subprocess.Popen = widened_popen
cfg = load_app_config(environ={}, overrides={"paths.data_dir": data_dir, "kafka.port": int(port),
                                             "kafka.controller_port": int(controller_port)})
LocalBroker(cfg, lib_dir=Path(lib_dir), stop_with_parent=True).start()
'''


class _NoKafkaProtocol:
    """The stand-in speaks no Kafka: once its port accepts, it counts as serving."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def list_topics(self) -> list[str]:
        return []


class StandIn:
    def __init__(self, tmp_path: Path) -> None:
        self.cfg = local_broker_config(tmp_path / "data", **{"kafka.startup_timeout_s": START_WAIT_S})
        self.lib_dir = tmp_path / "lib"
        self.lib_dir.mkdir()
        (self.lib_dir / ".complete").write_text("")  # resolved jars: nothing to fetch
        script = tmp_path / "stand_in_jvm.py"
        script.write_text(_STAND_IN_JVM)
        self.java_home = tmp_path / "jdk"
        java = self.java_home / "bin" / "java"
        java.parent.mkdir(parents=True)
        java.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(script))} \"$@\"\n")
        java.chmod(0o755)

    def broker(self) -> LocalBroker:
        return LocalBroker(self.cfg, lib_dir=self.lib_dir)

    def running(self) -> list[int]:
        """Pids of the stand-in brokers of this data directory still running."""
        wanted = str(self.broker().properties_file).encode()
        return [pid for pid in _pids() if _runs_broker(pid, wanted)]


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _runs_broker(pid: int, properties_file: bytes) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False  # gone meanwhile; a zombie's cmdline is empty
    return b"kafka.Kafka" in cmdline and properties_file in cmdline


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass  # gone already, or not this process's child (its parent died): init reaps it


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` exits (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("finds the brokers it started in /proc (Linux)")
    jvm = StandIn(tmp_path)
    monkeypatch.setenv("JAVA_HOME", str(jvm.java_home))
    monkeypatch.setattr(streams.broker, "KafkaBackend", _NoKafkaProtocol)
    yield jvm
    for pid in jvm.running():  # the ones these tests started, by their data directory
        _stop(pid)


def test_two_starts_at_once_leave_one_broker_and_the_pid_file_names_it(stand_in):
    """Both passed the pid check and launched a JVM; the loser lost Kafka's log-dir lock, and its
    clean-up removed the pid file, which by then named the winner: a broker nobody tracked."""
    brokers = [stand_in.broker(), stand_in.broker()]
    together = threading.Barrier(len(brokers))
    outcomes: list[bool | BaseException | None] = [None] * len(brokers)

    def start(i: int) -> None:
        together.wait()
        try:
            outcomes[i] = brokers[i].start()
        except BrokerError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(brokers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * START_WAIT_S)
    running = stand_in.running()
    assert len(running) == 1, outcomes
    assert stand_in.broker().pid() == running[0], outcomes
    assert sorted(outcomes, key=repr) == [False, True]  # the second waited for the first, then found it up


def test_a_failed_start_leaves_a_pid_file_that_names_another_broker(stand_in, monkeypatch):
    broker = stand_in.broker()
    other = os.getpid()  # any live process: the pid file is only read here

    def another_start_then_failure(self, pid: int) -> None:
        self.pid_file.write_text(f"{other}\n")  # a start that did not wait its turn (an older version)
        raise BrokerError("the broker exited during start-up")

    monkeypatch.setattr(LocalBroker, "_wait_ready", another_start_then_failure)
    with pytest.raises(BrokerError, match="exited during start-up"):
        broker.start()
    assert broker.pid_file.exists() and broker.pid_file.read_text() == f"{other}\n"
    assert stand_in.running() == []  # its own JVM was stopped


def test_a_broker_whose_parent_died_before_the_parent_death_signal_was_set_exits(stand_in, tmp_path):
    """The kernel signals only a parent's death after the prctl: a parent gone between fork and prctl
    (a killed test session) left a broker running for good."""
    pid_note = tmp_path / "broker-pid"
    k = stand_in.cfg.kafka
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(stand_in.cfg.data_dir), str(k.port), str(k.controller_port),
         str(stand_in.lib_dir), str(pid_note), str(FORK_TO_PRCTL_WINDOW_S)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + START_WAIT_S
        while not pid_note.exists():
            assert starter.poll() is None and time.monotonic() < deadline, "the starter never forked the broker"
            time.sleep(0.05)
    finally:
        starter.kill()  # inside the window: the broker sets its parent death signal only after this
        starter.wait()
    broker_pid = int(pid_note.read_text())
    gone = _gone(broker_pid, FORK_TO_PRCTL_WINDOW_S + PARENT_DEATH_WAIT_S)
    if not gone:
        _stop(broker_pid)
    assert gone, "the broker ran on after its parent died"


def test_a_stop_during_a_start_waits_for_it_and_stops_the_broker_it_started(stand_in, monkeypatch):
    """``kafka down`` while ``kafka up`` was between its pid check and its pid file: the stop said
    "not running" and the broker came up after it, running on untracked by the operator's down."""
    launching, stopped = threading.Event(), threading.Event()
    real_launch = LocalBroker._launch

    def launch_after_the_stop_had_its_chance(self) -> None:
        launching.set()
        stopped.wait(STOP_CHANCE_S)  # before the fix the stop returned inside this wait
        real_launch(self)

    monkeypatch.setattr(LocalBroker, "_launch", launch_after_the_stop_had_its_chance)
    starter = threading.Thread(target=stand_in.broker().start)
    starter.start()
    assert launching.wait(START_WAIT_S)
    stop_result = stand_in.broker().stop()
    stopped.set()
    starter.join(START_WAIT_S)
    assert stop_result is True  # it waited for the start and stopped that broker
    assert stand_in.running() == []
    assert not stand_in.broker().pid_file.exists()
