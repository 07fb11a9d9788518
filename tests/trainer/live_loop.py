"""The learner in a thread with serving's engine following its weights: the live loop the Kafka
learner tests drive (test_learner_kafka.py, test_regression_rollback_kafka.py).

:func:`live_loop` starts serving's TorchEngine, a WeightsFollower on the weights topic and
:func:`trainer.learner.train` in a thread; on leaving it stops all three, raises what the learner
thread raised (chained to the body's own error, if any) and checks that the thread ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from online_sao.config import Config
from online_sao.weights import FileWeightStore
from serving.engine.torch_engine import TorchEngine
from serving.weights_follower import WeightsFollower
from streams.kafka_backend import KafkaBackend
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train

LEARNER_JOIN_TIMEOUT_S = 120.0
"""How long the learner gets to finish its step and stop once told to (two shared cores)."""


@dataclass
class LiveLoop:
    engine: TorchEngine
    follower: WeightsFollower
    store: FileWeightStore
    learner: threading.Thread
    until: RunUntil = field(default_factory=RunUntil)
    failures: list[BaseException] = field(default_factory=list)


@contextmanager
def live_loop(cfg: Config, backend: KafkaBackend, model_dir: Path) -> Iterator[LiveLoop]:
    until = RunUntil()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            train(cfg, backend, init_distributed(), until)
        except BaseException as exc:  # surfaced by the main thread when the loop ends
            failures.append(exc)

    engine = TorchEngine.from_pretrained(model_dir)
    engine.start_thread()
    store = FileWeightStore(cfg.weight_store_url)
    follower = WeightsFollower(backend, cfg.kafka.topics.weights, store, engine)
    follower.start()
    loop = LiveLoop(engine, follower, store, threading.Thread(target=run, name="learner"), until, failures)
    loop.learner.start()
    try:
        yield loop
    finally:
        until.stop.set()
        loop.learner.join(timeout=LEARNER_JOIN_TIMEOUT_S)
        follower.stop()
        engine.stop_thread()
        if failures:  # the learner's own error, also when the body failed for it ("the learner thread died")
            raise failures[0]
    assert not loop.learner.is_alive(), f"the learner did not stop within {LEARNER_JOIN_TIMEOUT_S} s"
