"""The vLLM self-check's reference must fit in host memory (serving/engine/vllm_self_check.py): where it
would not, the check is skipped with a warning instead of a serving start killed for memory. No vLLM
needed: the decision comes before anything is served."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from online_sao.config import ConfigError
from online_sao.modeling import load_policy
from serving.engine import vllm_self_check
from serving.engine.vllm_self_check import available_host_memory, check_vllm_engine
from serving.engine.vllm_weights import ServedLayout

GB = 10**9
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


class UntouchedEngine:
    """Stands for vLLM's engine where the check must not serve anything: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the check used the engine ({name}) although it was to be skipped")


class RefusingEngine:
    """Stands for vLLM's engine where the check goes on: adding its first request fails."""

    def add_request(self, *args):
        raise RuntimeError("reached the engine")


def never_load(model_dir, dtype):
    raise AssertionError("the reference was loaded")


def test_a_reference_the_host_cannot_hold_skips_the_check_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(vllm_self_check, "load_policy", never_load)
    with caplog.at_level(logging.WARNING, logger=vllm_self_check.__name__):
        result = check_vllm_engine(UntouchedEngine(), lambda request: None, Path("unused"), torch.bfloat16, 100,
                                   LLAMA, weight_bytes=14 * GB, available_memory=lambda: 16 * GB)
    assert result is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "LlamaForCausalLM (model_type 'llama') in the vLLM engine skipped" in warning
    assert "about 21.0 GB of host memory (1.5x its weights), 16.0 GB are available" in warning


@pytest.mark.parametrize("available", [lambda: 21 * GB, lambda: None])
def test_a_reference_that_fits_or_an_unknown_memory_runs_the_check(available, monkeypatch):
    monkeypatch.setattr(vllm_self_check, "load_policy", never_load)
    with pytest.raises(ConfigError, match="its self-check .* failed with RuntimeError: reached the engine"):
        check_vllm_engine(RefusingEngine(), lambda request: None, Path("unused"), torch.bfloat16, 100, LLAMA,
                          weight_bytes=14 * GB, available_memory=available)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_available_memory_is_the_smaller_of_the_kernels_and_the_cgroups(tmp_path):
    meminfo = _write(tmp_path / "meminfo", "MemTotal:       32000000 kB\nMemAvailable:   8000000 kB\n")
    v2 = tmp_path / "v2"
    _write(v2 / "memory.max", "4294967296\n")
    _write(v2 / "memory.current", "1073741824\n")
    assert available_host_memory(meminfo, v2) == 3 * 2**30  # the container's limit, under MemAvailable
    _write(v2 / "memory.max", "max\n")
    assert available_host_memory(meminfo, v2) == 8_000_000 * 1024  # no limit: the kernel's figure
    v1 = tmp_path / "v1"
    _write(v1 / "memory" / "memory.limit_in_bytes", "2000000000\n")
    _write(v1 / "memory" / "memory.usage_in_bytes", "2500000000\n")
    assert available_host_memory(meminfo, v1) == 0  # over its limit already
    assert available_host_memory(tmp_path / "no-meminfo", tmp_path / "no-cgroup") is None


def test_the_served_layout_counts_each_parameter_once_in_the_served_dtype(tiny_model_dir):
    model = load_policy(tiny_model_dir)
    assert model.config.tie_word_embeddings  # the tied head must not be counted twice
    parameters = sum(p.numel() for p in model.parameters())  # yields a tied parameter once
    assert ServedLayout.of(tiny_model_dir, torch.bfloat16).nbytes == 2 * parameters
    assert ServedLayout.of(tiny_model_dir, torch.float32).nbytes == 4 * parameters
