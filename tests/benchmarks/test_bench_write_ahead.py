"""The write-ahead benchmark's report: its percentiles on hand-made latencies."""

from __future__ import annotations

from benchmarks.bench_write_ahead import report


def _cells(lines: list[str], prefix: str) -> list[str]:
    line = next(line for line in lines if line.startswith(prefix))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_median_of_two_latencies_lies_between_them():
    """ordered[int(q * n)] took the upper of the two middle values: the median of 2 samples was their max."""
    level = {1: ([0.001, 0.003], 2, 2)}  # seconds, records, fsyncs
    results = {("memory", 1): [0.001, 0.003], ("write_ahead", 1): [0.002, 0.006]}
    lines = report([], level, results, [1], 0.0)
    assert _cells(lines, "| 1 | 2 | 2 |")[4:6] == ["2.00", "2.98"]  # p50, p99 (rank 0.99 of 1)
    assert _cells(lines, "| 1 | memory |")[3] == "2.00"
    assert _cells(lines, "| 1 | write_ahead |")[3] == "4.00"
    assert "- concurrency 1: write_ahead adds +2.00 ms at p50, +2.98 ms at p99" in lines
