"""The shared-memory transports across real processes: a learner process saves (or publishes
on a real Kafka broker), another process loads and verifies. ``shm`` runs everywhere;
``cuda-ipc`` needs a GPU (``-m gpu``).

Run as a script, this file is that learner process: it reads one JSON command a line on
stdin and answers one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]
REPLY_TIMEOUT_S = 180.0
"""Longest wait for a child's answer (it imports torch first, on a loaded 2-core machine)."""
WAIT_S = 60.0
"""Longest wait for the follower to reach a state."""
PROBE = "model.norm.weight"
"""Set to the version number in published tiny-model weights, so the served version shows."""
TRANSPORTS = ["shm", pytest.param("cuda-ipc", marks=pytest.mark.gpu)]


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 16, generator=g), "norm.weight": torch.randn(16, generator=g).bfloat16(),
            "count": torch.tensor(seed)}


# ---- the learner process ----------------------------------------------------------------------

def learner_main(url: str, kafka_json: str, model_file: str, keep: str) -> None:
    from online_sao.weights import open_weight_store

    torch.set_num_threads(1)
    store = open_weight_store(url)
    publisher = None
    if kafka_json:  # only then: these imports cost seconds on a loaded machine
        from online_sao.config import KafkaConfig
        from streams.kafka_backend import KafkaBackend
        from trainer.publisher import Publisher

        cfg = KafkaConfig.model_validate_json(kafka_json)
        publisher = Publisher(store, KafkaBackend(cfg).producer(), cfg.topics.weights, "online-sao", int(keep))
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply = _execute(command, store, publisher, model_file)
        except Exception as exc:  # the parent asserts on the kind and the message
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps({**reply, "versions": store.versions()}), flush=True)
        if command["op"] == "quit":
            return


def _execute(command: dict, store, publisher, model_file: str) -> dict:
    from safetensors.torch import load_file

    from online_sao.weights import WeightsRef

    op = command["op"]
    if op == "save":
        return {"ref": asdict(store.save(command["version"], make_state(command["seed"])))}
    if op == "load":
        loaded = store.load(command["location"], command["checksum"])
        expected = make_state(command["seed"])
        return {"equal": loaded.keys() == expected.keys()
                and all(torch.equal(loaded[k].cpu(), v) for k, v in expected.items())}
    if op == "prune":
        return {"pruned": store.prune(command["keep_last"], set(command.get("protected", ())))}
    if op == "publish":
        state = load_file(model_file)
        state[PROBE] = torch.full_like(state[PROBE], float(command["version"]))
        return {"ref": asdict(publisher.publish(state, command["version"], step=command["version"]))}
    if op == "rollback":
        publisher.rollback(WeightsRef(**command["ref"]), step=0)
        return {}
    if op == "quit":
        return {}
    raise ValueError(f"unknown op {op}")


# ---- the test side ----------------------------------------------------------------------------

class Child:
    """A learner process driven over stdin/stdout."""

    def __init__(self, url: str, kafka_json: str = "", model_file: str = "", keep: int = 3):
        self.stderr = tempfile.TemporaryFile()
        # the repository first, then whatever the parent had (a GPU check's wheels directory, say)
        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__, url, kafka_json, model_file, str(keep)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, cwd=REPO_ROOT, env=env)

    def call(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stderr.seek(0)
            pytest.fail(f"learner process gave no answer to {op}: {self.stderr.read().decode()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call("quit")
        try:
            self.proc.wait(timeout=REPLY_TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.stderr.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def where(ref: dict) -> dict:
    return {"location": ref["location"], "checksum": ref["checksum"]}


@pytest.fixture
def url(request) -> Iterator[str]:
    from online_sao.weights import open_weight_store

    url = f"{request.param}://test-{uuid.uuid4().hex[:12]}"
    yield url
    store = open_weight_store(url)  # whatever a test left behind
    for version in store.versions():
        store.delete(version)


def flip_a_data_byte(url: str, version: int) -> None:
    """Corrupt the published bytes themselves, as the other process sees them."""
    kind, name = url.split("://")
    if kind == "shm":
        path = Path("/dev/shm") / f"online-sao.{name}.v{version:08d}.seg"
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(bytes(raw))
        return
    from online_sao.weights.cuda_ipc import IpcRecord, TorchCudaIpc

    record = IpcRecord.model_validate_json(
        (Path("/dev/shm") / f"online-sao.{name}.v{version:08d}.cuda-ipc.json").read_bytes())
    mapped = TorchCudaIpc().open(record.share, record.device_uuid)
    mapped[0] ^= 0x01
    torch.cuda.synchronize(mapped.device)
    del mapped


@pytest.mark.parametrize("url", TRANSPORTS, indirect=True)
def test_a_version_saved_in_one_process_is_verified_in_another(url):
    from online_sao.weights import open_weight_store

    with Child(url) as learner, Child(url) as reader:
        first = learner.call("save", version=1, seed=1)["ref"]
        second = learner.call("save", version=2, seed=2)
        assert second["versions"] == [1, 2]
        assert reader.call("load", **where(first), seed=1)["equal"] is True
        assert reader.call("load", **where(first), seed=2)["equal"] is False  # the comparison can fail

        flip_a_data_byte(url, 1)
        refused = reader.call("load", **where(first), seed=1)
        assert refused["error"] == "CorruptWeights" and "checksum" in refused["message"]

        assert learner.call("prune", keep_last=1)["pruned"] == [1]
        gone = reader.call("load", **where(first), seed=1)
        assert gone["error"] == "FileNotFoundError" and "pruned" in gone["message"]
        assert reader.call("load", **where(second["ref"]), seed=2)["equal"] is True
    assert learner.proc.returncode == 0

    # the learner process has ended: a segment stays (like a file), GPU memory does not
    store = open_weight_store(url)
    assert store.versions() == [2]  # a learner that starts again numbers past it and prunes it
    if url.startswith("shm://"):
        loaded = store.load(second["ref"]["location"], second["ref"]["checksum"])
        assert all(torch.equal(loaded[k], v) for k, v in make_state(2).items())
    else:
        with pytest.raises(FileNotFoundError, match="no longer holds"):
            store.load(second["ref"]["location"], second["ref"]["checksum"])


@pytest.mark.kafka
@pytest.mark.parametrize("url", TRANSPORTS, indirect=True)
def test_serving_swaps_to_what_a_learner_process_publishes(url, kafka_config, tiny_model_dir):
    from online_sao.modeling import load_policy
    from online_sao.weights import open_weight_store
    from serving.engine.torch_engine import TorchEngine
    from serving.weights_follower import WeightsFollower
    from streams.kafka_backend import KafkaBackend

    engine = TorchEngine(load_policy(tiny_model_dir).eval())
    results = []
    follower = WeightsFollower(KafkaBackend(kafka_config), kafka_config.topics.weights, open_weight_store(url),
                               engine, on_result=results.append)

    def served() -> float:
        return float(engine._model.state_dict()[PROBE][0])

    follower.start()
    try:
        with Child(url, kafka_config.model_dump_json(), str(tiny_model_dir / "model.safetensors"), keep=2) as learner:
            first = learner.call("publish", version=1)["ref"]
            assert first["location"].startswith(url)
            assert follower.wait_for(lambda: engine.policy_version == 1, WAIT_S)
            assert served() == 1.0
            learner.call("publish", version=2)
            assert learner.call("publish", version=3)["versions"] == [2, 3]  # keep_versions=2 pruned 1
            assert follower.wait_for(lambda: engine.policy_version == 3, WAIT_S)
            assert served() == 3.0

            learner.call("rollback", ref=first)  # to a pruned version: refused, serving stays
            assert follower.wait_for(lambda: results[-1].version == 1, WAIT_S)
            assert not results[-1].applied and "pruned" in results[-1].reason
            assert engine.policy_version == 3 and served() == 3.0
    finally:
        follower.stop()
    applied = [r.version for r in results if r.applied]  # 2 may have been skipped for 3 in one poll
    assert applied in ([1, 3], [1, 2, 3])


if __name__ == "__main__":
    learner_main(*sys.argv[1:])
