"""The agent run's success-rate summary and plot, from hand-built episodes."""

from __future__ import annotations

import json

import pytest

from apps.agent.episode import Episode
from apps.agent.results import PLOT_FILE, SUMMARY_FILE, summarize, version_points, window_points, write_results


def episode(i: int, reward: float, version: int, called: bool = True, finished_at: float | None = None) -> Episode:
    return Episode(index=i, question="q", expected="42", tool_uses=[], final_answer="", interaction_ids=[f"id{i}"],
                   policy_version=version, called=called, call_correct=reward == 1.0,
                   answer_correct=reward == 1.0, reward=reward,
                   finished_at=1000.0 + i if finished_at is None else finished_at, latency_s=0.1)


def test_rolling_window_over_tasks_in_finish_order():
    # started 0..3, finished in the order 3, 2, 1, 0: the window follows finish time
    episodes = [episode(i, r, v, finished_at=100.0 - i) for i, (r, v) in enumerate([(1, 2), (1, 1), (0, 0), (0, 0)])]
    points = window_points(episodes, window=2)
    assert [p.tasks for p in points] == [1, 2, 3, 4]
    assert [p.success_rate for p in points] == [0.0, 0.0, 0.5, 1.0]
    assert [p.policy_version for p in points] == [0, 0, 1, 2]


def test_success_by_policy_version():
    episodes = [episode(0, 1, 0), episode(1, 0, 0), episode(2, 1, 3), episode(3, 1, 3), episode(4, 0, 3)]
    assert [(p.policy_version, p.tasks, p.success_rate) for p in version_points(episodes)] == [
        (0, 2, 0.5), (3, 3, pytest.approx(2 / 3))]


def test_summary_first_and_last_window():
    episodes = [episode(i, 1.0 if i >= 6 else 0.0, i // 4, called=i % 2 == 0) for i in range(10)]
    summary = summarize(episodes, window=4, failed=1)
    assert summary["success_rate"] == 0.4 and summary["failed_tasks"] == 1
    assert summary["first_window_success_rate"] == 0.0 and summary["last_window_success_rate"] == 1.0
    assert summary["call_rate"] == 0.5 and summary["policy_versions"] == [0, 1, 2]


def test_writes_json_and_png(tmp_path):
    episodes = [episode(i, float(i % 2), i // 3) for i in range(9)]
    summary = write_results(episodes, window=3, failed=0, out=tmp_path, extra={"learner": {"steps": 2}})
    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert on_disk == summary and on_disk["learner"] == {"steps": 2} and len(on_disk["points"]) == 9
    assert (tmp_path / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([SUMMARY_FILE, PLOT_FILE])  # written whole, renamed
    with pytest.raises(RuntimeError, match="no task finished"):
        write_results([], window=3, failed=0, out=tmp_path)


def test_summary_has_the_correct_call_rate_of_the_first_and_last_window():
    # rewards 0 for the first 6 tasks, 1 after: call_correct follows the reward (see episode())
    episodes = [episode(i, 1.0 if i >= 6 else 0.0, 0) for i in range(10)]
    summary = summarize(episodes, window=4, failed=0)
    assert summary["correct_call_rate"] == 0.4
    assert summary["first_window_correct_call_rate"] == 0.0 and summary["last_window_correct_call_rate"] == 1.0
    episodes[8] = episode(8, 0.0, 0)
    assert summarize(episodes, window=4, failed=0)["last_window_correct_call_rate"] == 0.75
