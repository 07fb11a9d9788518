"""The packing benchmark runs end to end and reports both layouts on the same batches."""

from __future__ import annotations

from benchmarks.bench_packing import main


def test_the_packing_benchmark_reports_both_layouts(tmp_path):
    out = tmp_path / "packing.md"
    assert main(["--batches", "2", "--rollouts", "6", "--median", "6", "--max-tokens", "40", "--out", str(out)]) == 0
    text = out.read_text()
    padded = next(line for line in text.splitlines() if line.startswith("| padded |"))
    packed = next(line for line in text.splitlines() if line.startswith("| packed |"))
    share = {name: float(row.split("|")[2].strip().rstrip("%")) for name, row in (("padded", padded),
                                                                                ("packed", packed))}
    assert 0 <= share["packed"] < share["padded"] < 100  # ragged batches: packing removes padding
    assert "Packed / padded real tokens per second:" in text and text.count(", ") >= 1
