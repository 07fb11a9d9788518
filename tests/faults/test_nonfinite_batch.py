"""Fault: a batch whose loss is not finite reaches the live learner (issue #7).

No record from outside can carry such a batch any more: rewards are bounded
(``online_sao.schemas.MAX_ABS_REWARD``; the HTTP feedback endpoint answers 422
even earlier) and non-finite numbers never decode. So the fault is injected
after validation, through the learner's test-only ``before_step`` hook
(:data:`trainer.learner.RolloutHook`, passed in, nothing patched): this module
is also the learner's entry point (``python -m tests.faults.test_nonfinite_batch
--config ... --poison-file ...``), the real learner loop on the real broker,
whose hook gives every rollout listed in the poison file a final reward of
``1e38``; the critic's squared error ``(V - 1e38)^2`` then overflows float32.

The live stack runs (own broker, ``online-sao serve``, this learner) with traffic
flowing. One more interaction is asked for through the official openai client,
rewarded normally, and listed in the poison file. The step holding it must be
refused: its ids reach the ledger marked refused, the learner logs why,
``skipped_nonfinite_steps`` rises in MLflow, no weights notice carries that step,
and the learner goes on training and publishing. Every acknowledged interaction
(the poisoned one included) reaches the learner exactly once, and every
published weight is finite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from online_sao.batch import Rollout
from online_sao.schemas import WeightsNotice, decode
from streams.kafka_backend import KafkaBackend
from tests.faults.harness import LiveStack, Traffic, assert_exactly_once
from trainer.checkpoint import Checkpointer, read_ledger

REPO_ROOT = Path(__file__).resolve().parents[2]
OVERFLOW_REWARD = 1e38
"""A finite reward whose squared error against any value is inf in float32."""
FIRST_VERSION_S = 120.0
"""Until the learner's first version is published on two shared cores."""
TRAIN_WAIT_S = 120.0
"""Until a given interaction is in the learner's ledger."""
NOTICE_POLL_S = 20.0
"""Longest one read of the weights topic may take (it ends once caught up)."""
STOP_S = 60.0
"""A SIGTERM'd learner writes its last checkpoint and exits within this."""


class Poison:
    """The learner's ``before_step`` hook: rollouts whose id is listed in ``path`` (one a
    line, written by the test while the learner runs) get an overflowing final reward."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, rollouts: list[Rollout]) -> list[Rollout]:
        listed = set(self.path.read_text().split()) if self.path.exists() else set()
        return [replace(r, rewards={len(r.token_ids) - 1: OVERFLOW_REWARD}) if r.interaction_id in listed else r
                for r in rollouts]


def _start_poisoned_learner(stack: LiveStack, poison_file: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(stack.root / "logs" / "learner.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.faults.test_nonfinite_batch", "--config",
                                 str(stack.config_path), "--poison-file", str(poison_file)],
                                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _notices(stack: LiveStack) -> list[WeightsNotice]:
    consumer = KafkaBackend(stack.cfg.kafka).consumer([stack.cfg.kafka.topics.weights], group_id=None,
                                                      start="earliest")
    try:
        out, deadline = [], time.monotonic() + NOTICE_POLL_S
        while time.monotonic() < deadline:
            batch = consumer.poll(timeout_s=0.5)
            if out and not batch:  # caught up with the topic
                break
            out += [decode(m.value, WeightsNotice) for m in batch]
        return out
    finally:
        consumer.close()


def _wait(predicate, timeout_s: float, what: str, stack: LiveStack, learner: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert learner.poll() is None, f"the learner exited with {learner.returncode}\n{stack.log_tail('learner')}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s\n--- learner\n{stack.log_tail('learner')}")
        time.sleep(0.2)


@pytest.mark.kafka
def test_an_overflowing_batch_is_refused_counted_and_never_published(live_stack):
    stack = live_stack()
    stack.start_broker()
    KafkaBackend(stack.cfg.kafka).ensure_topics()
    poison_file = stack.root / "poison.txt"
    learner = _start_poisoned_learner(stack, poison_file)
    try:
        stack.start_component("serving")
        traffic = Traffic(stack.base_url, workers=2).start()
        try:
            _wait(lambda: stack.weight_versions(), FIRST_VERSION_S, "no version published", stack, learner)
            reply = stack.client().chat.completions.create(model="online-sao", max_tokens=8,
                                                           messages=[{"role": "user", "content": "poison me"}])
            poisoned = reply.model_extra["interaction_id"]
            poison_file.write_text(poisoned + "\n")
            feedback = httpx.post(f"{stack.base_url}/v1/feedback", json={"interaction_id": poisoned, "reward": 1.0},
                                  timeout=10.0)
            assert feedback.status_code == 200
            _wait(lambda: poisoned in stack.trained_ids(), TRAIN_WAIT_S, "the poisoned id not in the ledger",
                  stack, learner)
            refused = read_ledger(stack.ledger_path, refused=True)
            (step,) = {s for s, iid in refused if iid == poisoned}
            refused_ids = [iid for s, iid in refused if s == step]
            _wait(lambda: any(n.step > step for n in _notices(stack)), FIRST_VERSION_S,
                  "no publish after the refusal", stack, learner)  # the learner goes on
        finally:
            traffic.stop()
        acked = traffic.acked + [poisoned]
        _wait(lambda: set(acked) <= set(stack.trained_ids()), TRAIN_WAIT_S, "acknowledged ids not all trained",
              stack, learner)
    finally:
        learner.terminate()
        learner.wait(STOP_S)
    assert learner.returncode == 0, stack.log_tail("learner")

    assert step not in {n.step for n in _notices(stack)}, "the refused step published weights"
    log = (stack.root / "logs" / "learner.log").read_text()
    assert f"step {step} refused: non-finite loss or gradients" in log
    run_id = Checkpointer(stack.cfg.checkpoint_dir).load_latest().state.mlflow_run_id
    history = MlflowClient(tracking_uri=stack.cfg.mlflow_uri).get_metric_history(run_id, "skipped_nonfinite_steps")
    counts = {m.step: m.value for m in history}
    assert counts[step] == 1.0 and all(v == 0.0 for s, v in counts.items() if s < step)

    figures = assert_exactly_once(acked, stack.trained_ids())
    versions = stack.assert_published_weights_finite()
    print(f"nonfinite-batch: step {step} refused with {len(refused_ids)} ids ({max(counts.values()):.0f} refused "
          f"steps), {versions} finite versions published, none at step {step}; {figures}")


def main() -> int:
    """The learner of this scenario: ``online-sao learn`` with the poison hook passed in."""
    from apps.config import load_app_config
    from trainer.learner import run_learner

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--poison-file", type=Path, required=True)
    args = parser.parse_args()
    return run_learner(load_app_config(args.config, environ={}), before_step=Poison(args.poison_file))


if __name__ == "__main__":
    sys.exit(main())
