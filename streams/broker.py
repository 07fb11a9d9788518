"""A local single-node Apache Kafka broker (KRaft), started from jars resolved by Maven.

``LocalBroker`` owns everything under ``<data_dir>/kafka``::

    lib-<version>/       broker jars copied from Maven Central (streams/kafka/pom.xml)
    server.properties    written on every start from KafkaConfig
    data/                log.dirs: the topics' data, formatted once (meta.properties)
    broker.log           the JVM's stdout/stderr (log4j2 writes to stdout)
    broker.pid           pid of the running JVM
    broker.start.lock    held by a start until its broker serves or failed: starts take turns, a stop waits

``online-sao kafka up|down|status`` is streams/broker_cli.py.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from online_sao.config import Config
from streams.base import StreamUnavailable
from streams.kafka_backend import KafkaBackend

KAFKA_RESOURCES = Path(__file__).parent / "kafka"
POM = KAFKA_RESOURCES / "pom.xml"
LOG4J_CONFIG = KAFKA_RESOURCES / "log4j2.properties"
NODE_ID = 1
STOP_TIMEOUT_S = 60.0
"""A controlled shutdown of one idle node takes a few seconds; past this the JVM is killed."""
READY_POLL_S = 0.5
"""Pause between readiness probes while the broker starts (no busy wait)."""
LOG_TAIL_LINES = 20
"""Lines of the broker's log an error about a failed start shows."""
LOG_TAIL_BYTES = 64 * 1024
"""How much of the log's end is read for its last lines (a JVM stack trace's lines are long)."""
SMALL_MACHINE_JVM_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
"""C1 JIT only and the serial collector: measured on the 2-core dev machine, the broker's
start-up used about 40% less CPU (3.0-3.8 s of JVM CPU time instead of 5.6-6.2 s) and
came up sooner under load. Peak throughput is lower, far above what this service sends."""


class BrokerError(RuntimeError):
    """The local broker cannot be set up, started or stopped; ``detail`` holds log lines."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass
class BrokerStatus:
    running: bool
    bootstrap: str
    local: bool
    pid: int | None = None
    log_file: Path | None = None
    topics: dict[str, int] = field(default_factory=dict)
    """Topic name -> partition count (empty when not running)."""


class LocalBroker:
    """Resolves, formats, starts and stops the broker described by ``cfg.kafka``.

    ``lib_dir`` overrides where the jars are cached (tests share one cache).
    ``stop_with_parent`` (Linux) has the kernel SIGTERM the broker when the process that
    started it dies, so a killed test session leaves no broker behind; ``kafka up`` leaves
    it off: its broker outlives the command.
    """

    def __init__(self, cfg: Config, lib_dir: Path | None = None, stop_with_parent: bool = False) -> None:
        self.cfg = cfg
        self.stop_with_parent = stop_with_parent
        self.kafka = cfg.kafka
        self.root = cfg.data_dir / "kafka"
        self.lib_dir = (lib_dir or self.root / f"lib-{self.kafka.kafka_version}").expanduser().resolve()
        self.log_dirs = self.root / "data"
        self.properties_file = self.root / "server.properties"
        self.log_file = self.root / "broker.log"
        self.pid_file = self.root / "broker.pid"
        self.start_lock_file = self.root / "broker.start.lock"

    # -- set-up -------------------------------------------------------------------------

    def resolve_jars(self) -> Path:
        """Copy the broker's jars from Maven Central once; later calls return the cache. Processes
        resolving into one cache at once (parallel test workers) take turns: the first copies."""
        marker = self.lib_dir / ".complete"
        if marker.exists():
            return self.lib_dir
        self.lib_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lib_dir.with_name(self.lib_dir.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if marker.exists():
                return self.lib_dir
            return self._copy_jars()

    def _copy_jars(self) -> Path:
        mvn = _require_tool("mvn", "Maven")
        partial = self.lib_dir.with_name(self.lib_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [mvn, "-q", "-B", "-f", str(POM), f"-Dkafka.version={self.kafka.kafka_version}",
               "dependency:copy-dependencies", f"-DoutputDirectory={partial}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not any(partial.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"Maven could not resolve org.apache.kafka:kafka_2.13:{self.kafka.kafka_version} "
                              f"(exit {done.returncode}); command: {' '.join(cmd)}",
                              _tail(done.stdout + done.stderr))
        (partial / ".complete").write_text("\n".join(sorted(p.name for p in partial.glob("*.jar"))) + "\n")
        shutil.rmtree(self.lib_dir, ignore_errors=True)
        partial.rename(self.lib_dir)
        return self.lib_dir

    def server_properties(self) -> str:
        k = self.kafka
        props = {
            "process.roles": "broker,controller",
            "node.id": NODE_ID,
            # A static voter set: ports are read from this file on every start, so a
            # changed controller_port needs no re-format.
            "controller.quorum.voters": f"{NODE_ID}@{k.host}:{k.controller_port}",
            "listeners": f"PLAINTEXT://{k.host}:{k.port},CONTROLLER://{k.host}:{k.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{k.host}:{k.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": self.log_dirs,
            "auto.create.topics.enable": "false",
            "num.partitions": 1,
            "default.replication.factor": 1,
            "offsets.topic.replication.factor": 1,
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
            # Small-machine sizing: the internal offsets topic defaults to 50 partitions and
            # the log cleaner to a 128 MiB buffer, both heavy for a 512 MiB heap on 2 cores.
            "offsets.topic.num.partitions": 4,
            "log.cleaner.dedupe.buffer.size": 16 * 1024 * 1024,
            "num.network.threads": 2,
            "num.io.threads": 4,
            "group.initial.rebalance.delay.ms": 0,
        }
        return "".join(f"{key}={value}\n" for key, value in props.items())

    def format_storage(self, java: str) -> None:
        """Format log.dirs once; an existing meta.properties means it is formatted."""
        if (self.log_dirs / "meta.properties").exists():
            return
        self.log_dirs.mkdir(parents=True, exist_ok=True)
        cmd = [java, *self._jvm_flags(heap_mb=256), "kafka.tools.StorageTool", "format",
               "-t", _new_cluster_id(), "-c", str(self.properties_file)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BrokerError(f"formatting {self.log_dirs} failed (exit {done.returncode})",
                              _tail(done.stdout + done.stderr))

    # -- lifecycle ----------------------------------------------------------------------

    def pid(self) -> int | None:
        """Pid of this data directory's running broker, or None."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _is_our_broker(pid, self.properties_file) else None

    def start(self) -> bool:
        """Start the broker and wait until it serves; False when it was already running.

        Starts of one data directory take turns (two ``kafka up`` at once, two stacks on one data_dir):
        each holds the start lock from its pid check until its broker serves or failed, so a second
        start waits for the first and then finds its broker running. Without the lock both passed the
        checks, both launched a JVM, and the loser's clean-up removed the pid file of the winner's
        broker, which then ran with nothing tracking it (``kafka down`` said it was not running)."""
        if not self.kafka.is_local:
            raise BrokerError(f"kafka.bootstrap_servers is set ({self.kafka.bootstrap}); no local broker is started")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.start_lock_file, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; the JVM does not inherit it
            if self.pid() is not None:
                return False
            self._launch()
        return True

    def _launch(self) -> None:
        """Check the ports, format, start the JVM and wait until it serves (the caller holds the start lock)."""
        java = _require_tool("java", "Java 17+", env_home="JAVA_HOME")
        for name, port in (("kafka.port", self.kafka.port), ("kafka.controller_port", self.kafka.controller_port)):
            if not _port_free(self.kafka.host, port):
                raise BrokerError(f"port {port} on {self.kafka.host} is already in use ({name}); "
                                  f"stop what listens there or choose another port")
        self.resolve_jars()
        self.properties_file.write_text(self.server_properties())
        self.format_storage(java)
        cmd = [java, *self._jvm_flags(self.kafka.heap_mb), "kafka.Kafka", str(self.properties_file)]
        with open(self.log_file, "ab") as log:
            log.write(f"\n==== online-sao: starting broker {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.root, start_new_session=True,
                                    preexec_fn=_stop_with_parent(os.getpid()) if self.stop_with_parent else None)
        self.pid_file.write_text(f"{proc.pid}\n")
        try:
            self._wait_ready(proc.pid)
        except (BrokerError, KeyboardInterrupt):  # an operator's Ctrl-C too: no half-started broker left behind
            self._terminate(proc.pid, timeout_s=10.0)
            self._forget_pid(proc.pid)
            raise

    def _forget_pid(self, pid: int) -> None:
        """Remove the pid file while it names ``pid``: one naming another broker keeps tracking that one."""
        try:
            named = self.pid_file.read_text().strip()
        except FileNotFoundError:
            return
        if named == str(pid):
            self.pid_file.unlink(missing_ok=True)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """SIGTERM (controlled shutdown), SIGKILL after ``timeout_s``; False when not running.

        Takes the start lock, so a stop during a start (``kafka down`` while ``kafka up`` waits for its
        broker) waits for it and stops the broker it started. Without the lock the stop said "not
        running" before the start had written its pid file, and the broker ran on after the stop."""
        if not self.root.exists():  # never started here: nothing to wait for, no directory to create
            return self._stop(timeout_s)
        with open(self.start_lock_file, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        clean = self._terminate(pid, timeout_s)
        self.pid_file.unlink(missing_ok=True)
        if not clean:
            raise BrokerError(f"broker (pid {pid}) did not stop within {timeout_s:.0f} s and was killed; "
                              f"see {self.log_file}")
        return True

    def status(self) -> BrokerStatus:
        pid = self.pid()
        st = BrokerStatus(running=pid is not None, bootstrap=self.kafka.bootstrap, local=True,
                          pid=pid, log_file=self.log_file)
        if st.running:
            st.topics = KafkaBackend(self.kafka).describe_topics()
        return st

    # -- helpers ------------------------------------------------------------------------

    def _jvm_flags(self, heap_mb: int) -> list[str]:
        return [f"-Xmx{heap_mb}m", f"-Xms{min(heap_mb, 128)}m", "-XX:+ExitOnOutOfMemoryError",
                *SMALL_MACHINE_JVM_FLAGS,
                "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
                # Kafka logs its own controlled shutdown from its shutdown hook; log4j's hook
                # would stop logging first and drop those lines.
                "-Dlog4j2.shutdownHookEnabled=false",
                f"-Dkafka.logs.dir={self.root}", "-cp", str(self.lib_dir / "*")]

    def _wait_ready(self, pid: int) -> None:
        """Return once the broker answers a metadata request (a protocol check, not a port probe)."""
        timeout = self.kafka.startup_timeout_s
        deadline = time.monotonic() + timeout
        backend = KafkaBackend(self.kafka.model_copy(update={"client_timeout_s": 2.0}))
        while True:
            if not _alive(pid):
                raise BrokerError(f"the broker exited during start-up; log: {self.log_file}", self._log_tail())
            if _port_accepts(self.kafka.host, self.kafka.port):
                try:
                    backend.list_topics()
                    return
                except StreamUnavailable:
                    pass
            if time.monotonic() >= deadline:
                raise BrokerError(f"the broker did not accept connections within {timeout:g} s "
                                  f"(kafka.startup_timeout_s); it was stopped; log: {self.log_file}",
                                  self._log_tail())
            time.sleep(READY_POLL_S)

    def _terminate(self, pid: int, timeout_s: float) -> bool:
        """True when the process exited on SIGTERM, False when it had to be killed."""
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return True
        if _wait_exit(pid, timeout_s):
            return True
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        _wait_exit(pid, 10.0)
        return False

    def _log_tail(self) -> str:
        """The log's last lines, read from its end: the log is appended to at every start and never
        rotated (about 0.8 MB a day), and a failed start read all of it."""
        try:
            with open(self.log_file, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                return _tail(fh.read().decode(errors="replace"))
        except FileNotFoundError:
            return ""


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _require_tool(name: str, what: str, env_home: str | None = None) -> str:
    if env_home and os.environ.get(env_home):
        candidate = Path(os.environ[env_home]) / "bin" / name
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise BrokerError(f"{name} not found on PATH: the local Kafka broker needs {what} "
                          f"(or set kafka.bootstrap_servers to use an existing cluster)")
    return found


def _new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not cid.startswith("-"):  # a leading dash would read as a command-line flag
            return cid


def _parent_death_signal():
    """A function for Popen's preexec_fn that makes the child get SIGTERM when this process
    dies (Linux prctl PR_SET_PDEATHSIG, kept across exec), or None where there is no prctl.
    prctl is looked up here, before the fork, so the child only makes one system call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def _stop_with_parent(parent_pid: int):
    """Popen's preexec_fn for the broker: SIGTERM when this process dies (:func:`_parent_death_signal`),
    and an exit at once when it died already, between the fork and the prctl: no signal comes then,
    and the broker ran on with no one to stop it. None where there is no prctl."""
    set_parent_death_signal = _parent_death_signal()
    if set_parent_death_signal is None:
        return None

    def preexec() -> None:
        set_parent_death_signal()
        if os.getppid() != parent_pid:  # reparented: the parent is gone
            os._exit(1)
    return preexec


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as the JVM sets it: TIME_WAIT leftovers of a stopped broker do not
        # count as "in use", a listening socket does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """Running (not a zombie); reaps the broker when this process is its parent."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def _is_our_broker(pid: int, properties_file: Path) -> bool:
    if not _alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return True  # no /proc (not Linux): trust the pid file
    return b"kafka.Kafka" in cmdline and str(properties_file).encode() in cmdline


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True
