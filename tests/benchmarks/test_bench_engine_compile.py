"""The engine-compile benchmark runs both engines on the same workload and reports their ratio."""

from __future__ import annotations

import pytest

from benchmarks.bench_engine_compile import main


# flat's compile takes 30-50 s on 2 cores: the slow lane; the compiled flat engine itself is tested in the default run
@pytest.mark.parametrize("kv_layout", [pytest.param("flat", marks=pytest.mark.slow), "padded"])
def test_the_engine_compile_benchmark_reports_both_engines(tmp_path, tiny_model_dir, kv_layout):
    out = tmp_path / "engine_compile.md"
    assert main(["--model-dir", str(tiny_model_dir), "--requests", "6", "--concurrency", "3", "--median-tokens", "4",
                 "--max-tokens", "12", "--repeats", "1", "--kv-layout", kv_layout, "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert sorted(row[2].strip() for row in rows) == ["compiled", "eager"]
    assert all(float(row[4]) > 0 for row in rows)  # tokens/s
    assert "compiled / eager tokens/s:" in text and "warm-up and compilation" in text
    assert f"({kv_layout} KV layout)" in text
