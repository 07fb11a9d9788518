"""Publish-to-serve time of one policy version through each weight transport, across processes.

This process is the learner: it saves (``store.save``: finiteness, layout, write,
checksum) the state dict of the default architecture at ``--size`` (random
weights, ``--dtype``, on the CPU as the learner's ``full_state_dict`` gives it).
A second process is serving: it loads what was saved (``store.load``: read or
map, checksum, finiteness; for ``cuda-ipc`` the copy out of the learner's GPU
buffer) and answers with its time. Transports: the file store in a temporary
directory, ``shm://`` and, with a GPU, ``cuda-ipc://``. Each is timed
``--repeats`` times after one warm-up, transports interleaved.

    python benchmarks/gpu/transports.py --out transports.json [--size half-b] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import REPO, device, machine, random_model, synchronize, write_result  # noqa: E402
from online_sao.weights import open_weight_store  # noqa: E402

REPLY_TIMEOUT_S = 300.0
"""Longest wait for the serving process to load one version (a large state dict on a busy machine)."""


def serving_main() -> None:
    """The serving process: one JSON request a line on stdin, one JSON answer a line on stdout."""
    stores = {}
    for line in sys.stdin:
        request = json.loads(line)
        store = stores.setdefault(request["url"], open_weight_store(request["url"]))
        start = time.perf_counter()
        state = store.load(request["location"], request["checksum"])
        synchronize(device())
        seconds = time.perf_counter() - start
        print(json.dumps({"load_s": seconds, "tensors": len(state),
                          "on": sorted({t.device.type for t in state.values()})}), flush=True)
        del state


class Serving:
    def __init__(self) -> None:
        # the repository first, then whatever check.sh put there (its --wheels directory)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serving"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)

    def load(self, url: str, ref) -> dict:
        self.proc.stdin.write(json.dumps({"url": url, "location": ref.location, "checksum": ref.checksum}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the serving process ended (exit status {self.proc.wait(REPLY_TIMEOUT_S)})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(REPLY_TIMEOUT_S)


def transports(workdir: Path) -> dict[str, str]:
    urls = {"file": str(workdir / "store"), "shm": f"shm://bench-{uuid.uuid4().hex[:8]}"}
    if torch.cuda.is_available():
        urls["cuda-ipc"] = f"cuda-ipc://bench-{uuid.uuid4().hex[:8]}"
    return urls


def run(args) -> dict:
    where = device()
    state = {k: v.detach().to("cpu", copy=True)
             for k, v in random_model(args.size, args.dtype, torch.device("cpu")).state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        urls = transports(Path(tmp))
        stores = {name: open_weight_store(url) for name, url in urls.items()}
        serving = Serving()
        try:
            for rep in range(args.repeats + 1):  # the first round warms up
                for name, store in stores.items():
                    start = time.perf_counter()
                    ref = store.save(rep + 1, state)
                    saved = time.perf_counter() - start
                    answer = serving.load(urls[name], ref)
                    store.delete(rep + 1)
                    print(f"round {rep} ({'timed' if rep else 'warm-up'}) {name}: save {saved:.2f} s, "
                          f"load {answer['load_s']:.2f} s", file=sys.stderr, flush=True)
                    if rep:
                        times.setdefault(name, {"save_s": [], "load_s": []})
                        times[name]["save_s"].append(saved)
                        times[name]["load_s"].append(answer["load_s"])
                        times[name]["loaded_on"] = answer["on"]
        finally:
            serving.close()
            for store in stores.values():
                for version in store.versions():
                    store.delete(version)
    medians = {name: {"save_ms": 1e3 * statistics.median(t["save_s"]), "load_ms": 1e3 * statistics.median(t["load_s"]),
                      "loaded_on": t["loaded_on"]} for name, t in times.items()}
    skipped = {} if "cuda-ipc" in urls else {"cuda-ipc": "needs a CUDA device"}
    return {"machine": machine(where), "size": args.size, "dtype": args.dtype, "tensors": len(state),
            "mib": nbytes / 2**20, "repeats": args.repeats, "times": times, "medians": medians, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--serving"]:
        serving_main()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=["half-b", "tiny"], default="half-b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    return write_result(args.out, "transports", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
