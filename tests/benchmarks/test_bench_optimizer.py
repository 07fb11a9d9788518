"""The optimizer-kernel benchmark runs end to end and reports both kernels on the same batches."""

from __future__ import annotations

from benchmarks.bench_optimizer import KERNELS, main


def test_the_optimizer_benchmark_reports_each_kernel(tmp_path):
    out = tmp_path / "optimizer.md"
    assert main(["--batches", "2", "--rollouts", "3", "--median", "6", "--max-tokens", "40", "--out", str(out)]) == 0
    text = out.read_text()
    for kernel in KERNELS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {kernel} |"))
        step_s, optimizer_s = (float(cell) for cell in row.split("|")[2:4])
        assert 0 < optimizer_s < step_s  # the optimiser steps are part of the SAO step
    assert "foreach / fused step time over all batches:" in text
