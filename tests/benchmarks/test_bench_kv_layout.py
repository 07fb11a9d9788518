"""The KV-layout benchmark runs both layouts on the same workload and reports their ratio."""

from __future__ import annotations

from benchmarks.bench_kv_layout import main


def test_the_kv_layout_benchmark_reports_both_layouts(tmp_path, tiny_model_dir):
    out = tmp_path / "kv_layout.md"
    assert main(["--model-dir", str(tiny_model_dir), "--requests", "6", "--concurrency", "3", "--median-tokens", "4",
                 "--max-tokens", "12", "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert sorted(row[2].strip() for row in rows) == ["flat", "padded"]
    assert all(float(row[4]) > 0 for row in rows)  # tokens/s
    assert "flat / padded tokens/s:" in text
