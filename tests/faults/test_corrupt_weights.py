"""Fault: weights notices on the real weights topic that point at bad weights (issue #7).

The live stack runs (own broker, ``online-sao serve``, ``online-sao learn``) with
traffic flowing; the learner starts after the notices and publishes only its starting
policy (``trainer.publish_every`` out of reach), so the version serving runs changes
only through the notices this test writes. Three bad notices, each with a version
newer than the served one:

1. a corrupt file: a real policy file with bytes flipped, announced with the
   checksum of the intact file (checksum mismatch);
2. a file that is well-formed and checksums correctly but holds a NaN
   (refused by the finiteness check);
3. a path where no file exists.

After each, serving must still run the old version (``/v1/models`` and the
``policy_version`` of new answers), keep answering, count the refusal
(``sao_serving_weight_swaps_total{outcome="not_applied"}``) and log why. A good
notice afterwards is still applied. Every acknowledged interaction is trained on
exactly once and every published weight is finite.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from online_sao.schemas import WeightsNotice
from online_sao.weights import sha256_hex
from streams.kafka_backend import KafkaBackend
from streams.records import publish
from tests.faults.harness import LiveStack, Traffic, assert_exactly_once

NEVER = 1_000_000
"""trainer.publish_every: the learner trains but publishes no version during the scenario."""
SWAP_WAIT_S = 60.0
"""How long the weights follower may take to read and judge one notice on a loaded box."""
TRAIN_WAIT_S = 120.0
"""Until every acknowledged interaction is in the learner's ledger after traffic stops."""
NOT_APPLIED = re.compile(r'^sao_serving_weight_swaps_total\{outcome="not_applied"\} (\S+)$', re.M)
APPLIED = re.compile(r'^sao_serving_weight_swaps_total\{outcome="applied"\} (\S+)$', re.M)


def _swaps(stack: LiveStack, pattern: re.Pattern) -> float:
    found = pattern.search(httpx.get(f"{stack.base_url}/metrics", timeout=10.0).text)
    return float(found.group(1)) if found else 0.0


def _served_version(stack: LiveStack) -> int:
    (card,) = httpx.get(f"{stack.base_url}/v1/models", timeout=10.0).json()["data"]
    return card["policy_version"]


def _answer_version(stack: LiveStack) -> int:
    reply = stack.client().chat.completions.create(model="online-sao", max_tokens=4,
                                                   messages=[{"role": "user", "content": "which version?"}])
    return reply.model_extra["policy_version"]


def _wait(predicate, timeout_s: float, what: str, stack: LiveStack) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s\n--- serving\n{stack.log_tail('serving')}")
        time.sleep(0.2)


def _bad_files(policy_file: Path, where: Path) -> dict[str, tuple[Path, str]]:
    """name -> (location, checksum announced) of each bad notice."""
    where.mkdir()
    intact = policy_file.read_bytes()
    flipped = bytearray(intact)
    for i in range(len(flipped) - 64, len(flipped)):  # tensor bytes at the end of the file
        flipped[i] ^= 0xFF
    (where / "flipped.safetensors").write_bytes(bytes(flipped))
    state = load_file(str(policy_file))
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(where / "nan.safetensors"))
    return {
        "checksum mismatch": (where / "flipped.safetensors", sha256_hex(intact)),
        "non-finite values": (where / "nan.safetensors", sha256_hex((where / "nan.safetensors").read_bytes())),
        "missing file": (where / "never-written.safetensors", sha256_hex(b"nothing")),
    }


@pytest.mark.kafka
def test_bad_weights_notices_keep_the_old_version_serving_and_a_good_one_still_applies(live_stack, tiny_model_dir):
    stack = live_stack({"trainer.publish_every": NEVER})
    stack.start_broker()
    KafkaBackend(stack.cfg.kafka).ensure_topics()
    stack.start_component("serving")  # the learner starts after the notices (below)
    old = _served_version(stack)
    traffic = Traffic(stack.base_url, workers=2).start()
    producer = KafkaBackend(stack.cfg.kafka).producer()
    bad = _bad_files(tiny_model_dir / "model.safetensors", stack.root / "bad-weights")
    serving_log = stack.root / "logs" / "serving.log"
    try:
        for i, (why, (location, checksum)) in enumerate(bad.items(), start=1):
            refused_before, answered_before = _swaps(stack, NOT_APPLIED), traffic.count(200)
            publish(producer, stack.cfg.kafka.topics.weights,
                    WeightsNotice(version=old + 10 * i, location=str(location), checksum=checksum))
            producer.flush()
            _wait(lambda: _swaps(stack, NOT_APPLIED) > refused_before, SWAP_WAIT_S, f"{why}: no refusal counted",
                  stack)
            assert _served_version(stack) == old, why
            assert _answer_version(stack) == old, why
            assert f"cannot load version {old + 10 * i} from {location}" in serving_log.read_text(), why
            assert f"keeping version {old}" in serving_log.read_text(), why
            traffic.wait_for(lambda: traffic.count(200) > answered_before, SWAP_WAIT_S)  # the clients still get answers

        good = stack.root / "good.safetensors"
        good.write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
        new = old + 100
        applied_before = _swaps(stack, APPLIED)
        publish(producer, stack.cfg.kafka.topics.weights,
                WeightsNotice(version=new, location=str(good), checksum=sha256_hex(good.read_bytes())))
        producer.flush()
        _wait(lambda: _served_version(stack) == new, SWAP_WAIT_S, "the good notice was not applied", stack)
        assert _swaps(stack, APPLIED) == applied_before + 1
        assert _answer_version(stack) == new
        # started now, it reads every notice before it numbers its policy (trainer/startup.py); started
        # with serving, it raced them: which ones it had read depended on how long its start took
        stack.start_component("learner")
    finally:
        producer.close()
        traffic.stop()

    log = serving_log.read_text()
    assert "checksum mismatch" in log and "non-finite values" in log and "No such file" in log
    assert traffic.statuses.keys() == {200}, traffic.statuses  # nothing failed while the notices came
    stack.wait_trained(traffic.acked, TRAIN_WAIT_S)
    figures = assert_exactly_once(traffic.acked, stack.trained_ids())
    # the learner published only its own policy, numbered past every version the topic announced; the
    # bad files are outside the store
    assert stack.assert_published_weights_finite() == 1 and stack.weight_versions() == [new + 1]
    print(f"corrupt-weights: served v{old} through {len(bad)} bad notices, then v{new}; {figures}")
