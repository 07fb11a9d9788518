"""Run the service's processes side by side: broker, serving, learner, judge.

Used by ``online-sao demo`` and the experiments. Every component is started as
its own ``online-sao`` subprocess with the same configuration file and
overrides, exactly as an operator would start it; logs go to ``<run_dir>/logs``.

The components run in sessions of their own (a Ctrl-C at the terminal reaches only this process,
which stops them in order) and get SIGTERM when this process dies, even by SIGKILL (Linux's parent
death signal): they were left running, serving holding its port and spool lock. That signal
follows the *thread* that started the child, so a stack starts its children only from the thread
that created it, which holds it (``with``) as long as they run.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

from apps.config import AppConfig, load_app_config
from online_sao.config import ENV_PREFIX, Config, TopicsConfig
from online_sao.durable import PRIVATE_FILE_MODE, private_opener

READY_POLL_S = 0.5
"""Pause between readiness probes of a starting process (no busy wait)."""
STOP_TIMEOUT_S = 30.0
"""A process asked to stop (SIGTERM) that is still alive after this is killed."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that end this process without unwinding (an operator's kill, a CI timeout; the terminal
closed, an ssh session dropped): inside a stack they raise SystemExit, so that it stops its
components. SIGHUP is left ignored where it was (``nohup``)."""


class StackError(RuntimeError):
    """A component did not start; the message names it and points at its log."""


@dataclass
class Component:
    name: str
    process: subprocess.Popen
    log_path: Path


def _as_set_text(value: Any) -> str:
    """``value`` as ``--set`` text: a string as it is (a text field takes it as written, so YAML's
    quotes would become part of it), anything else as flow YAML."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@dataclass
class Stack:
    """Processes of one run sharing ``config_path`` plus ``overrides``."""

    config_path: Path | None
    overrides: dict[str, Any]
    run_dir: Path
    progress: Callable[[str], None] = print
    resolved: bool = False
    """``config_path`` is a resolved dump (:func:`online_sao.config.dump_config`) that the run changed
    after reading the environment (a free port, its own topics and directories): neither the children
    nor :attr:`cfg` apply ``ONLINE_SAO__*`` variables again, which would undo those changes."""
    components: list[Component] = field(default_factory=list)
    broker: Any = None
    _previous_handlers: dict[signal.Signals, Any] = field(default_factory=dict)
    _owner: threading.Thread = field(default_factory=threading.current_thread)
    """The thread that created the stack, the only one that starts its children (see the module's doc)."""

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)

    @property
    def cfg(self) -> AppConfig:
        return load_app_config(self.config_path, environ={} if self.resolved else None, overrides=self.overrides)

    def _child_env(self, env: dict[str, str] | None) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if not (self.resolved and k.startswith(ENV_PREFIX))}
        return {**inherited, **(env or {})}

    def _cli_args(self, extra_overrides: dict[str, Any] | None = None) -> list[str]:
        args = [sys.executable, "-m", "apps.cli"]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        for key, value in {**self.overrides, **(extra_overrides or {})}.items():
            args += ["--set", f"{key}={_as_set_text(value)}"]
        return args

    def start_broker(self) -> str:
        """Start the local broker unless the configuration names a cluster; returns bootstrap."""
        from streams.kafka_backend import KafkaBackend

        cfg = self.cfg
        if cfg.kafka.is_local:
            from streams.broker import LocalBroker

            broker = LocalBroker(cfg, stop_with_parent=True)
            started = broker.start()
            if started:  # a broker someone else started (`kafka up`) is theirs to stop, not this run's
                self.broker = broker
            self.progress(f"kafka: {'started' if started else 'already running'} at {cfg.kafka.bootstrap} "
                          f"(log {broker.log_file})")
        else:
            self.progress(f"kafka: using {cfg.kafka.bootstrap}")
        KafkaBackend(cfg.kafka).ensure_topics()
        return cfg.kafka.bootstrap

    def start(self, name: str, command: list[str], extra_overrides: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> Component:
        """Start ``online-sao <command...>`` as a subprocess logging to logs/<name>.log."""
        if threading.current_thread() is not self._owner:
            # the child's parent death signal would come when this thread ends, not the process
            raise RuntimeError(f"{name}: a stack starts its processes from the thread that created it "
                               f"({self._owner.name}), not from {threading.current_thread().name}")
        log_path = self.run_dir / "logs" / f"{name}.log"
        log = open(log_path, "ab")
        proc = subprocess.Popen(self._cli_args(extra_overrides) + command, stdout=log, stderr=subprocess.STDOUT,
                                env=self._child_env(env), start_new_session=True,
                                preexec_fn=_stop_with_parent(os.getpid()))
        log.close()
        comp = Component(name, proc, log_path)
        self.components.append(comp)
        self.progress(f"{name}: started (pid {proc.pid}, log {log_path})")
        return comp

    def wait_http(self, comp: Component, url: str, timeout_s: float) -> None:
        """Wait until ``url`` answers 200 while the component is alive."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if comp.process.poll() is not None:
                raise StackError(f"{comp.name} exited with {comp.process.returncode}; see {comp.log_path}:\n"
                                 + tail(comp.log_path))
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(READY_POLL_S)
        raise StackError(f"{comp.name} not ready at {url} after {timeout_s:.0f} s; see {comp.log_path}")

    def check_alive(self) -> None:
        for comp in self.components:
            if comp.process.poll() is not None:
                raise StackError(f"{comp.name} exited with {comp.process.returncode}; see {comp.log_path}:\n"
                                 + tail(comp.log_path))

    def stop(self, name: str) -> int | None:
        for comp in [c for c in self.components if c.name == name]:
            try:
                _terminate([comp.process])
            finally:
                self.components.remove(comp)
            return comp.process.returncode
        return None

    def stop_components(self) -> None:
        """Stop every component (together: see :func:`_terminate`); the broker stays up."""
        try:
            _terminate([comp.process for comp in reversed(self.components)])
        finally:
            self.components.clear()

    def stop_all(self) -> None:
        """Stop every component (together: see :func:`_terminate`), then the broker this run started.

        Components were stopped one after the other, each waited on for up to STOP_TIMEOUT_S, and a
        second Ctrl-C during a slow shutdown ended the wait with every component not yet stopped
        left running (in sessions of their own, so the terminal's signals miss them): serving kept
        its port and spool lock. Now none is left: an interrupt while waiting kills the rest before
        it goes on, and the broker, then not stopped here, gets SIGTERM when this process exits
        (its parent death signal)."""
        self.stop_components()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    def __enter__(self) -> "Stack":
        # A SIGTERM or SIGHUP would end this process without running __exit__: the components
        # would get only their parent death signal, the broker this run started left to its own.
        # As SystemExit the process unwinds here and stops them in order.
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous_handlers[signum] = signal.signal(signum, exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers.clear()


RUN_ID_RANDOM_BYTES = 2
"""Random bytes at the end of a run id: with the second it starts in, 65536 ids per second, enough for
the operators of one cluster."""


def new_run(runs_dir: Path, kind: str) -> tuple[str, Path]:
    """A run id (``<kind>-<UTC date>-<time>-<4 hex digits>``) and its directory under ``runs_dir``, created here.

    The id names the run's topics, consumer group, ledger and MLflow experiment
    (:func:`own_state_overrides`): two runs started in the same second (two operators, a retry in a
    script) shared them all. The random digits keep runs on different hosts or data directories apart
    on a shared broker and MLflow; creating the directory exclusively keeps two with the same digits on
    one data directory apart (the second draws again)."""
    stem = time.strftime(f"{kind}-%Y%m%d-%H%M%S", time.gmtime())
    runs_dir.mkdir(parents=True, exist_ok=True)
    while True:
        run_id = f"{stem}-{secrets.token_hex(RUN_ID_RANDOM_BYTES)}"
        try:
            (runs_dir / run_id).mkdir()
        except FileExistsError:
            continue
        return run_id, runs_dir / run_id


def own_state_overrides(cfg: Config, run_id: str, run_dir: Path) -> dict[str, Any]:
    """Overrides that give a run beside the deployment (``online-sao smoke``, ``online-sao load``) state
    of its own, named after ``run_id`` and kept under ``run_dir``: topics and the learner's consumer
    group (``<cfg's name>.<run_id>``; a run that passed removes them with what :mod:`apps.run_state`
    names), weight store, checkpoints (the learner's ledger with them), serving's spool, an MLflow
    experiment and registered model (``<cfg's name>.<run_id>``), and a free port for the learner's
    metrics where ``cfg`` serves them.

    Smoke's learner resumed the deployment's checkpoint, trained it on made-up rewards and published
    onto the weights topic every replica follows; both runs registered versions into the deployment's
    registered model, whose aliases (champion, candidate) production's canary and the learner's
    roll-back read. The tracking URI stays ``cfg``'s: the run still exercises the configured server."""
    overrides: dict[str, Any] = {
        # the deployment's names with the run's after them, as an experiment's arm has: a cluster that
        # grants topics and groups by prefix grants these too
        **{f"kafka.topics.{role}": f"{getattr(cfg.kafka.topics, role)}.{run_id}" for role in TopicsConfig.model_fields},
        "trainer.consumer_group": f"{cfg.trainer.consumer_group}.{run_id}",
        "trainer.weight_store": str(run_dir / "weights"),
        "trainer.checkpoint_dir": str(run_dir / "checkpoints"),
        "serving.spool_dir": str(run_dir / "spool"),
        "mlflow.experiment": f"{cfg.mlflow.experiment}.{run_id}",
        "mlflow.registered_model": f"{cfg.mlflow.registered_model}.{run_id}"}
    if cfg.trainer.metrics_port is not None:  # the deployment's learner may hold that port
        overrides["trainer.metrics_port"] = 0
    return overrides


def threads_env(threads: int) -> dict[str, str]:
    """Environment that caps a process's OpenMP/MKL (and so torch's) threads at ``threads``."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def write_private(path: Path, text: str) -> None:
    """Write a run's config, which holds secrets: readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", opener=private_opener) as fh:
        os.fchmod(fh.fileno(), PRIVATE_FILE_MODE)  # the opener's applies to a new file only
        fh.write(text)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it), for a process of the stack."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM (or SIGHUP) handler: raise ``SystemExit(128 + signum)``, so the process unwinds and stops
    what it started (the signal's default action ends it at once, its children left running)."""
    raise SystemExit(128 + signum)


def _stop_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """Popen's preexec_fn for a component: SIGTERM when this process dies (the broker's parent death
    signal), and an exit at once when it already died before the signal was set (no signal comes then)."""
    from streams.broker import _parent_death_signal

    set_parent_death_signal = _parent_death_signal()
    if set_parent_death_signal is None:  # no prctl: not Linux
        return None

    def preexec() -> None:
        set_parent_death_signal()
        if os.getppid() != parent_pid:
            os._exit(1)
    return preexec


def _terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process still running, then wait for all of them against one deadline
    (STOP_TIMEOUT_S), then SIGKILL whoever is left: a slow one does not hold up the others' signal.
    Interrupted while waiting (a second Ctrl-C, a SIGTERM), it kills every one still running before
    the interrupt goes on, so none is left behind."""
    running = [proc for proc in procs if proc.poll() is None]
    try:
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
        for proc in running:
            proc.wait()  # killed: no wait to speak of


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""
