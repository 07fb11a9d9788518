"""The live-stack fault harness: the real service under traffic, faults, and the checks of issue #7.

API (small on purpose; the scenarios in this package use only this):

``LiveStack(root, model_dir, kafka_lib_dir, overrides={...})``
    One run of the real service under ``root``: its own Kafka broker on free
    ports (:class:`streams.broker.LocalBroker`, data kept across stop/start),
    serving and learner as ``online-sao serve`` / ``online-sao learn``
    subprocesses (:class:`apps.stack.Stack`) sharing one YAML file, the
    tiny model, MLflow in a SQLite file under ``root``. ``overrides`` are dotted
    config keys on top of :data:`BASE_OVERRIDES`.

    * ``start()`` -> broker, topics, learner, serving (ready); returns the stack.
    * ``start_broker()`` / ``stop_broker()``: the broker fault (graceful stop).
      ``pause_broker()`` / ``resume_broker()``: SIGSTOP / SIGCONT (a broker that
      hangs: connections stay open, nothing is acknowledged).
    * ``start_component(name, extra_overrides=None, env=None)`` with name
      ``"serving"`` or ``"learner"``; serving is waited for until /readyz is 200.
    * ``kill(name)``: SIGKILL, waits for the exit. ``stop(name)``: SIGTERM.
      ``restart(name, ...)``: start it again with the same configuration.
    * ``base_url``, ``client()`` (official ``openai`` client), ``readyz()``,
      ``metric(name)`` (a serving gauge or counter from /metrics).
    * ``trained_ids()``: every interaction id in the learner's ledger, one entry
      per time a committed step took it (steps refused as non-finite included:
      their ids were handled, once).
    * ``wait_trained(ids, timeout_s)``: until every id is in the ledger.
    * ``join_counters()``: the reward join's counters in the newest checkpoint
      (``duplicate_interactions``: copies the learner dropped).
    * ``weight_versions()``, ``assert_published_weights_finite()``: loads every
      version in the weight store and checks every float tensor is finite.
    * ``log_tail(name)``: the end of a component's log, for assertion messages.
    * ``close()``: everything stopped (the fixture does it).

``Traffic(base_url, workers=2, stream_every=2)`` (in :mod:`tests.faults.traffic`, imported here)
    Client threads using the official ``openai`` client (``max_retries=0``):
    chat requests (every ``stream_every``-th worker streams), then a reward
    through ``POST /v1/feedback`` for each acknowledged interaction; a reward
    that cannot be delivered (server down, 503) is retried until ``stop()``
    drains them. ``start()``, ``stop(drain_s)``, ``acked`` (interaction ids
    whose complete response the client received), ``statuses`` (Counter of
    HTTP statuses, ``"connection_error"`` when the server could not be
    reached, ``"stream_error"`` for an error event after a stream began),
    ``refusals`` (the messages of 503s and stream errors), ``events`` (time,
    status) per request, ``unrewarded`` (acked ids whose reward never got through).

Checks: ``assert_exactly_once(acked, trained)`` -> :class:`ExactlyOnce`
figures (acked ids each trained exactly once, nothing trained twice);
``assert_recovered(stack, traffic, timeout_s)`` -> :class:`Recovered`: that, after waiting for the
training, plus every acked id rewarded and finite weights published.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import httpx
import torch
import yaml
from safetensors.torch import load_file

from apps.config import load_app_config
from apps.stack import Component, Stack, free_port, tail
from online_sao.schemas import decode
from online_sao.weights import open_weight_store
from streams.broker import LocalBroker
from streams.kafka_backend import KafkaBackend
from streams.tail import records_since
from tests.fixtures.kafka import local_broker_config
from tests.faults.traffic import CLIENT_TIMEOUT_S, POLL_S, Traffic
from tests.fixtures.models import TINY_MODEL_OVERRIDES
from trainer.checkpoint import LEDGER_DIR, read_ledger

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING_READY_S = 240.0
"""Serving start on two shared cores: torch import, model load, first readiness probe."""

BASE_OVERRIDES: dict[str, Any] = {
    "serving.torch_threads": 1,
    "serving.max_new_tokens": 16,
    "serving.rate_limit_per_minute": 100_000,
    "serving.rate_limit_burst": 1_000,
    "serving.log_stall_s": 2.0,
    "serving.log_retry_s": 0.5,
    "serving.shutdown_flush_s": 5.0,
    "trainer.min_rollouts": 2,
    "trainer.max_rollouts_per_step": 32,  # catches up quickly after a fault
    "trainer.max_wait_s": 1.0,
    "trainer.poll_timeout_s": 0.1,
    "trainer.keep_versions": 10_000,  # every published version stays readable for the finiteness check
    "mlflow.register_every": 100_000,
    "mlflow.log_every_steps": 1,  # the scenarios read each step's metrics
}
"""Small, quick settings every fault scenario starts from (a scenario's overrides win)."""


class HarnessError(AssertionError):
    """The stack did not do what a scenario waited for; the message carries the logs' tails."""


@dataclass(frozen=True)
class ExactlyOnce:
    acked: int
    """Interactions whose response the client received."""
    trained: int
    """Ledger entries (an id trained twice counts twice)."""
    unacked_trained: int
    """Ids trained although their client saw no complete response (allowed: logged, then the answer was lost)."""


def assert_exactly_once(acked: Iterable[str], trained: Iterable[str]) -> ExactlyOnce:
    """Every acknowledged id trained exactly once, and no id trained more than once."""
    acked, counts = list(acked), Counter(trained)
    missing = [i for i in acked if counts[i] == 0]
    repeated = {i: n for i, n in counts.items() if n > 1}
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged interactions never trained: {missing[:5]}"
    assert not repeated, f"interactions trained more than once: {dict(list(repeated.items())[:5])}"
    assert len(set(acked)) == len(acked), "the server acknowledged one interaction id twice"
    return ExactlyOnce(len(acked), sum(counts.values()), len(set(counts) - set(acked)))


DUPLICATE_SETTLE_S = 2.0
"""After the last acknowledged id trained: long enough for a copy trained twice to reach the ledger."""


@dataclass(frozen=True)
class Recovered:
    figures: ExactlyOnce
    versions: int
    """Published weight versions, all checked finite."""
    train_s: float
    """Seconds until the last acknowledged interaction was trained."""


def assert_recovered(stack: "LiveStack", traffic: Traffic, timeout_s: float) -> Recovered:
    """After a fault: every acknowledged interaction trained exactly once and rewarded, and the learner
    published weights, all finite. Fails also if the learner exited."""
    train_s = stack.wait_trained(traffic.acked, timeout_s)
    time.sleep(DUPLICATE_SETTLE_S)
    figures = assert_exactly_once(traffic.acked, stack.trained_ids())
    versions = stack.assert_published_weights_finite()
    assert versions > 0 and traffic.unrewarded == []
    return Recovered(figures, versions, train_s)


TOPIC_READ_S = 60.0
"""Longest read of a whole topic of a fault scenario (a few hundred records)."""


@dataclass(frozen=True)
class TopicCopies:
    interactions: Counter
    """Interaction id -> records with that id on the interactions topic."""
    rewards: Counter
    """Reward record bytes -> copies on the rewards topic."""

    @property
    def duplicates(self) -> int:
        """Copies beyond the first, of interactions and rewards."""
        return sum(n - 1 for counts in (self.interactions, self.rewards) for n in counts.values())


class LiveStack:
    """See the module docstring."""

    def __init__(self, root: Path, model_dir: Path, kafka_lib_dir: Path, overrides: dict[str, Any] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        data_dir = self.root / "data"
        broker_cfg = local_broker_config(data_dir)
        self.broker = LocalBroker(broker_cfg, lib_dir=kafka_lib_dir, stop_with_parent=True)
        self.port = free_port()
        kafka = broker_cfg.kafka.model_dump(mode="json", exclude_none=True)
        kafka["bootstrap_servers"] = broker_cfg.kafka.bootstrap  # the children use it as an existing cluster
        settings = {"paths.data_dir": str(data_dir), "model.path": str(model_dir), "serving.port": self.port,
                    "trainer.consumer_group": f"learner-{self.root.name}",
                    "mlflow.tracking_uri": f"sqlite:///{self.root / 'mlflow.db'}",
                    **{k: v for k, v in TINY_MODEL_OVERRIDES.items()}, **BASE_OVERRIDES, **(overrides or {})}
        self.config_path = self.root / "stack.yaml"
        self.config_path.write_text(yaml.safe_dump(_nest({"kafka": kafka, **settings})))
        self.cfg = load_app_config(self.config_path, environ={})
        self._stack = Stack(self.config_path, {}, self.root, progress=lambda line: None)
        self._extra: dict[str, tuple[dict[str, Any] | None, dict[str, str] | None]] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "LiveStack":
        self.start_broker()
        KafkaBackend(self.cfg.kafka).ensure_topics()
        self.start_component("learner")
        self.start_component("serving")
        return self

    def start_broker(self) -> None:
        self.broker.start()

    def stop_broker(self) -> None:
        self.broker.stop()

    def pause_broker(self) -> None:
        os.kill(self._broker_pid(), signal.SIGSTOP)

    def resume_broker(self) -> None:
        os.kill(self._broker_pid(), signal.SIGCONT)

    def _broker_pid(self) -> int:
        pid = self.broker.pid()
        if pid is None:
            raise HarnessError("the broker is not running")
        return pid

    def start_component(self, name: str, extra_overrides: dict[str, Any] | None = None,
                        env: dict[str, str] | None = None) -> Component:
        """Start ``serving`` or ``learner``; serving is waited for until /readyz answers 200."""
        command = {"serving": ["serve"], "learner": ["learn"]}[name]
        self._extra[name] = (extra_overrides, env)
        child_env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                     "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        comp = self._stack.start(name, command, extra_overrides, env=child_env)
        if name == "serving":
            self._stack.wait_http(comp, f"{self.base_url}/readyz", SERVING_READY_S)
        return comp

    def component(self, name: str) -> Component:
        found = [c for c in self._stack.components if c.name == name]
        if not found:
            raise HarnessError(f"{name} is not running")
        return found[0]

    def kill(self, name: str) -> int:
        """SIGKILL ``name`` and wait for it; returns the exit status."""
        comp = self.component(name)
        comp.process.send_signal(signal.SIGKILL)
        code = comp.process.wait(60)
        self._stack.components.remove(comp)
        return code

    def stop(self, name: str) -> int | None:
        """SIGTERM (graceful), SIGKILL after apps.stack.STOP_TIMEOUT_S."""
        return self._stack.stop(name)

    def restart(self, name: str, extra_overrides: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> Component:
        """Start ``name`` again (stopping it first if it runs); same extras as before unless given."""
        if any(c.name == name for c in self._stack.components):
            self.stop(name)
        before = self._extra.get(name, (None, None))
        return self.start_component(name, extra_overrides if extra_overrides is not None else before[0],
                                    env if env is not None else before[1])

    def close(self) -> None:
        pid = self.broker.pid()
        if pid is not None:
            os.kill(pid, signal.SIGCONT)  # a paused broker cannot stop
        self._stack.stop_all()
        self.broker.stop()

    # ------------------------------------------------------------------ clients

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key="not-needed-on-loopback", max_retries=0,
                      timeout=CLIENT_TIMEOUT_S, **kwargs)

    def readyz(self) -> tuple[int, dict]:
        response = httpx.get(f"{self.base_url}/readyz", timeout=10.0)
        return response.status_code, response.json()

    def metric(self, name: str) -> float:
        """The value of an unlabelled serving metric (gauge or counter) from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise HarnessError(f"serving exports no metric {name}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        return tail(self.root / "logs" / f"{name}.log", lines)

    # ------------------------------------------------------------------ checks

    @property
    def ledger_path(self) -> Path:
        return self.cfg.checkpoint_dir / LEDGER_DIR

    def trained_ids(self) -> list[str]:
        return [iid for _, iid in read_ledger(self.ledger_path)]

    def wait_trained(self, ids: Iterable[str], timeout_s: float) -> float:
        """Wait until every id is in the ledger; returns the seconds it took."""
        wanted, started = set(ids), time.monotonic()
        while not wanted <= set(self.trained_ids()):
            if time.monotonic() - started > timeout_s:
                missing = wanted - set(self.trained_ids())
                raise HarnessError(f"{len(missing)} of {len(wanted)} ids not trained within {timeout_s:.0f} s\n"
                                   f"--- serving\n{self.log_tail('serving')}\n--- learner\n{self.log_tail('learner')}")
            self._stack.check_alive()
            time.sleep(POLL_S)
        return time.monotonic() - started

    def join_counters(self) -> dict[str, float]:
        """Counters of the reward join in the newest committed checkpoint ({} before the first)."""
        found = sorted(self.cfg.checkpoint_dir.glob("step-*/meta.json"))
        if not found:
            return {}
        return json.loads(found[-1].read_text())["state"]["joiner"]["counters"]

    def copies_on_topics(self) -> "TopicCopies":
        """How often each interaction id and each reward (its exact bytes) is on the topics."""
        t, backend = self.cfg.kafka.topics, KafkaBackend(self.cfg.kafka)
        interactions = Counter(decode(m.value).interaction_id
                               for m in records_since(backend, [t.interactions], 0, TOPIC_READ_S))
        rewards = Counter(m.value for m in records_since(backend, [t.rewards], 0, TOPIC_READ_S))
        return TopicCopies(interactions, rewards)

    def weight_versions(self) -> list[int]:
        return open_weight_store(self.cfg.weight_store_url).versions()

    def assert_published_weights_finite(self) -> int:
        """Load every version in the weight store; each float tensor must be finite. Returns the count."""
        versions = self.weight_versions()
        for version in versions:
            path = Path(self.cfg.weight_store_url) / f"v{version:08d}.safetensors"
            for name, tensor in load_file(str(path)).items():
                assert not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()), \
                    f"published version {version}: tensor {name} is not finite"
        return len(versions)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = out
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


__all__ = ["BASE_OVERRIDES", "POLL_S", "ExactlyOnce", "HarnessError", "LiveStack", "Traffic", "assert_exactly_once"]
