"""Sizes, devices and result files the GPU checks share (benchmarks/gpu/check.sh).

Each check is its own process and writes one JSON file; ``report.py`` turns them
into benchmarks/results/gpu.md. A check that cannot run writes why instead of
numbers, so the report always says what happened to every section.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file: the repository's packages are importable
    sys.path.insert(0, str(REPO))

from apps.config import BaseModelConfig  # noqa: E402
from benchmarks.common import random_default_model  # noqa: E402

PEAK_BF16_DENSE_TFLOPS = {"H200": 989.4, "H100": 989.4}
"""Dense bf16 tensor-core peak of NVIDIA's datasheets (SXM parts; the 1979 TFLOP/s they
also print assume 2:4 sparsity). MFU is measured against this figure, matched by a
substring of the device name; other GPUs get no MFU."""

SIZES = {
    # the Qwen2-0.5B shape (24 layers, width 896, 14 heads of 64, 2 KV heads, Qwen's 151936-token
    # vocabulary, tied embeddings): 494 M parameters, the default architecture at half a billion
    "half-b": BaseModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                              num_heads=14, num_kv_heads=2, max_position_embeddings=4096),
    # the dry run's: everything runs, in seconds, on a CPU
    "tiny": BaseModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                            num_kv_heads=1, max_position_embeddings=256),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def random_model(size: str, dtype: str, where: torch.device) -> torch.nn.Module:
    """The default architecture at ``size`` with random weights (seed 0), in ``dtype`` on ``where``."""
    return random_default_model(SIZES[size]).to(device=where, dtype=DTYPES[dtype])


def peak_tflops(where: torch.device) -> float | None:
    """The dense bf16 peak of the GPU at ``where``; None on a CPU or an unlisted GPU."""
    if where.type != "cuda":
        return None
    name = torch.cuda.get_device_name(where)
    return next((peak for key, peak in PEAK_BF16_DENSE_TFLOPS.items() if key in name), None)


def synchronize(where: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock times cover it (nothing to wait for on a CPU)."""
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def machine(where: torch.device) -> dict[str, Any]:
    facts = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
             "cpus": os.cpu_count(), "device": str(where)}
    if where.type == "cuda":
        props = torch.cuda.get_device_properties(where)
        facts |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                  "cuda": torch.version.cuda}
    return facts


def write_result(out: Path, section: str, body: Callable[[], dict[str, Any]]) -> int:
    """Run ``body`` and write ``{"section", "ok", ...}`` to ``out``: its results, or the error
    that stopped it (type, message, the traceback's end). Returns the exit status."""
    try:
        result = {"section": section, "ok": True, **body()}
    except Exception as exc:  # the report says what failed; the other sections still run
        result = {"section": section, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, default=str)[:2000], flush=True)
    return 0 if result["ok"] else 1


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")
"""CUDA runtime calls a profile counts: the host waits in the first three, and torch waits on the stream
after a blocking copy (the fourth and fifth, unless the copy was non-blocking)."""


def profile_summary(work: Callable[[], Any], where: torch.device, units: int, top: int = 12) -> dict[str, Any]:
    """Run ``work`` once under torch's profiler: its wall time, how long the GPU was busy in it (the
    sum of its kernels' and copies' times; work on streams that overlap, as FSDP2's gathers do with
    compute, counts twice, so a share near or over 100% means a GPU kept busy), the CUDA runtime
    calls that make the host wait, and the ``top`` kernels by GPU time (operations by CPU time on a
    CPU), each per one of ``units`` (a step, a token). On a CPU the GPU fields are None: the dry run
    only shows that it runs. Events it cannot read are reported, not raised: they only add to a result."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = where.type == "cuda"
    synchronize(where)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        start = time.perf_counter()
        work()
        synchronize(where)
        wall = time.perf_counter() - start
    try:
        return summarise(prof.events(), wall, on_gpu, units, top)
    except Exception as exc:  # the profiler's event API differs between torch versions: the numbers stand
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def summarise(events, wall: float, on_gpu: bool, units: int, top: int) -> dict[str, Any]:
    """:func:`profile_summary`'s figures from the profiler's events."""
    from torch.autograd import DeviceType

    totals: dict[str, list[float]] = {}  # name -> [seconds, calls]
    for e in events:
        if on_gpu and e.device_type == DeviceType.CUDA:
            seconds = e.time_range.elapsed_us() / 1e6
        elif not on_gpu and e.name.startswith("aten::") and (e.cpu_parent is None
                                                            or not e.cpu_parent.name.startswith("aten::")):
            seconds = e.cpu_time_total / 1e6  # top-level operations only, so nothing counts twice
        else:
            continue
        entry = totals.setdefault(e.name[:80], [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    busy = sum(seconds for seconds, _ in totals.values()) if on_gpu else None
    waits = {name: sum(1 for e in events if e.name == name) / units for name in SYNC_CALLS}
    ranked = sorted(totals.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return {"units": units, "wall_ms_per_unit": 1e3 * wall / units,
            "gpu_busy_ms_per_unit": None if busy is None else 1e3 * busy / units,
            "gpu_busy_share": None if busy is None else busy / wall,
            "waits_per_unit": {name: count for name, count in waits.items() if count},
            "top_by": "GPU time (kernels and copies)" if on_gpu else "CPU time (top-level operations)",
            "top": [{"name": name, "ms_per_unit": 1e3 * seconds / units, "calls_per_unit": calls / units}
                    for name, (seconds, calls) in ranked]}
