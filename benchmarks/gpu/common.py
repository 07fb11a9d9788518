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
