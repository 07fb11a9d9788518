"""The learner memory benchmark: its slope, and a tiny end-to-end run that writes the report and the plot
(its broker's retention is tested in tests/streams/test_memory_retention.py)."""

from __future__ import annotations

import re

from benchmarks.bench_learner_memory import main, slope


def test_the_slope_is_the_least_squares_one():
    assert slope([0, 1, 2, 3], [1.0, 2.0, 2.0, 5.0]) == 1.2  # by hand: sum dx*dy = 6, sum dx^2 = 5
    assert slope([4, 4], [1.0, 9.0]) is None


def test_a_tiny_run_reports_its_samples_and_slope_and_plots_rss(tiny_model_dir, tmp_path):
    out = tmp_path / "memory.md"
    assert main(["--steps", "6", "--sample-every", "2", "--fit-from", "2", "--model-dir", str(tiny_model_dir),
                 "--set", "reward.memory_s=10", "--set", "reward.window_s=5", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row[0]) for row in rows] == [0, 2, 4, 5]  # every second step and before the last one
    assert all(float(row[2]) > float(row[3]) > 0 for row in rows)  # RSS, then malloc in use, in MiB
    assert int(rows[-1][4]) > 0  # the learner's id memory was found and holds the trained ids
    assert re.search(r"\*\*RSS: -?\d+\.\d+ KiB/step\*\*", text)
    assert re.search(r"\*\*malloc in use: -?\d+\.\d+ KiB/step\*\*", text)
    assert "id memory horizon 10 s" in text
    assert (tmp_path / "memory.png").read_bytes().startswith(b"\x89PNG")
    assert "![RSS over steps](memory.png)" in text
