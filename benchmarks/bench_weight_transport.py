"""Save + load time of a published version through each weight transport (issue 8).

Transports: the default file store (safetensors + SHA-256) in a directory of the
system temporary directory, the same file store in ``/dev/shm`` (tmpfs: the file
format without a disk under it), and the ``shm://`` store (JSON table + raw bytes
in a shared-memory segment). ``cuda-ipc://`` needs a GPU and is not measured here.

State dicts: the default model (the built one under data/models/base when it has
the default BaseModelConfig, else random weights of that architecture) and a
random state dict 10x its size (ten copies of every tensor, random values).

``save`` is ``store.save`` (verify finiteness, lay out, write, checksum); ``load``
is ``store.load`` (read, checksum, parse, finiteness), what serving runs for
every swap. Each transport and size is timed ``--repeats`` times, transports
interleaved so the noise of a shared machine spreads over all of them; the
table gives the median and the minimum. ``sha256`` is hashing the same number of
bytes once, ``finiteness`` the finiteness check once: both sides of every
transport pay each.

    .venv/bin/python benchmarks/bench_weight_transport.py [--repeats 7] [--out benchmarks/results/weight_transport.md]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import random_default_model  # noqa: E402
from apps.default_model.builder import is_built
from apps.config import BaseModelConfig, load_app_config
from online_sao.weights import FileWeightStore, WeightStore
from online_sao.weights.shm import DEFAULT_SHM_ROOT, ShmWeightStore
from online_sao.weights.store import verify_state_dict

SCALE = 10
"""The larger state dict is this many times the default model."""


def default_state() -> tuple[dict[str, torch.Tensor], str]:
    cfg = load_app_config()
    base = BaseModelConfig()
    if is_built(cfg.model_dir, base):
        from safetensors.torch import load_file

        return load_file(cfg.model_dir / "model.safetensors"), f"the built default model at {cfg.model_dir}"
    model = random_default_model(base)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, \
        f"random weights of the default {base.architecture} architecture"


def scaled(state: dict[str, torch.Tensor], factor: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"copy{i}.{k}": torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v.clone()
            for i in range(factor) for k, v in state.items()}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(path.resolve()).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return f"{kind} at {best}"


def time_once(store: WeightStore, version: int, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    start = time.perf_counter()
    ref = store.save(version, state)
    saved = time.perf_counter()
    store.load(ref.location, ref.checksum)
    loaded = time.perf_counter()
    store.delete(version)
    return saved - start, loaded - saved


def bench(stores: dict[str, WeightStore], state: dict[str, torch.Tensor], repeats: int) -> dict[str, dict]:
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
    for name, store in stores.items():  # warm-up: first-touch allocations, imports
        time_once(store, 0, state)
    for rep in range(repeats):
        for name, store in stores.items():
            times[name].append(time_once(store, rep + 1, state))
    data = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in state.values())
    hashes = []
    for _ in range(repeats):
        start = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        hashes.append(time.perf_counter() - start)
    checks = []
    for _ in range(repeats):
        start = time.perf_counter()
        verify_state_dict(state)
        checks.append(time.perf_counter() - start)
    out = {name: {"save": [s for s, _ in t], "load": [ld for _, ld in t]} for name, t in times.items()}
    out["sha256"] = {"save": hashes, "load": hashes}
    out["finiteness"] = {"save": checks, "load": checks}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weight_transport.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    state, which = default_state()
    sizes = {"default model": state, f"{SCALE}x default (random)": scaled(state, SCALE)}
    results = {}
    with tempfile.TemporaryDirectory() as disk_dir, \
            tempfile.TemporaryDirectory(dir=DEFAULT_SHM_ROOT, prefix="online-sao-bench-") as tmpfs_dir:
        shm = ShmWeightStore(f"bench-{uuid.uuid4().hex[:8]}")
        stores = {"file (temp dir)": FileWeightStore(disk_dir), "file (/dev/shm)": FileWeightStore(tmpfs_dir),
                  "shm://": shm}
        try:
            for label, sd in sizes.items():
                results[label] = bench(stores, sd, args.repeats)
                print(label, {k: round(statistics.median(v["save"]) + statistics.median(v["load"]), 4)
                              for k, v in results[label].items()}, flush=True)
        finally:
            for version in shm.versions():
                shm.delete(version)
        write_report(args, which, sizes, results, load_at_start, fs_type(Path(disk_dir)))
    return 0


def write_report(args, which, sizes, results, load_at_start, disk_fs) -> None:
    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f})"

    lines = [
        "# Weight transports: save + load time (CPU)", "",
        f"- command: `{shlex.join([sys.executable.split('/')[-1]] + sys.argv)}`",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} logical CPUs (shared with other "
        f"work; 1-min load average {load_at_start:.1f} at start), torch {torch.__version__}, "
        f"{args.threads} torch thread(s), Python {platform.python_version()}, no GPU",
        f"- state dicts: {which}; the larger one is {SCALE} copies of every tensor with random values",
        f"- file store directory: {disk_fs}; `file (/dev/shm)`: the same store in tmpfs",
        f"- milliseconds, median (minimum) of {args.repeats} repeats after one warm-up; `sha256` is hashing the "
        "state's bytes once and `finiteness` the check that no floating-point value is NaN or infinite "
        "(online_sao.weights.store.verify_state_dict), each of which every transport does on save and again "
        "on load", "",
        "Where the time goes: every transport checks finiteness and hashes the bytes on save and again on load; "
        "those four passes are most of the `shm://` time. What `shm://` skips is the rest of the file path: on "
        "save the clone and the safetensors serialisation before the write, on load the read into private "
        "memory and the safetensors parse (it maps the segment copy-on-write instead). The file store in "
        "/dev/shm shows how little of the file path's cost is the disk itself at these sizes (the page cache "
        "absorbs the writes; nothing is fsynced). Read the numbers against the load average above: on this "
        "shared 2-core machine the spread between repeats is large.", "",
    ]
    for label, res in results.items():
        sd = sizes[label]
        lines += [f"## {label}: {len(sd)} tensors, {nbytes(sd) / 2**20:.1f} MiB", "",
                  "| transport | save ms | load ms | save + load ms (medians) |", "|---|---:|---:|---:|"]
        for name, r in res.items():
            if name in ("sha256", "finiteness"):  # one pass, paid on save and again on load
                lines.append(f"| {name} alone | {ms(r['save'])} | {ms(r['load'])} | "
                             f"{2 * statistics.median(r['save']) * 1e3:.1f} |")
                continue
            total = (statistics.median(r["save"]) + statistics.median(r["load"])) * 1e3
            lines.append(f"| {name} | {ms(r['save'])} | {ms(r['load'])} | {total:.1f} |")
        lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
