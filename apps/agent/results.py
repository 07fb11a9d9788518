"""The agent run's results: success rate over time (rolling window over tasks, and by policy
version) as JSON and a PNG plot. matplotlib's object API only (no pyplot, no global backend)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from apps.agent.episode import Episode

EPISODES_FILE, SUMMARY_FILE, PLOT_FILE = "episodes.jsonl", "summary.json", "success.png"


@dataclass(frozen=True)
class WindowPoint:
    tasks: int
    """Tasks finished so far (the point's x)."""
    success_rate: float
    """Mean reward of the last ``window`` finished tasks (fewer at the start)."""
    call_rate: float
    """Share of those tasks in which the model called a tool."""
    policy_version: int | None
    """Policy version of the newest of those tasks."""


@dataclass(frozen=True)
class VersionPoint:
    policy_version: int
    tasks: int
    success_rate: float


def window_points(episodes: list[Episode], window: int) -> list[WindowPoint]:
    """One point per finished task (in finish order): rates over the last ``window`` tasks."""
    ordered = sorted(episodes, key=lambda e: e.finished_at)
    points = []
    for end in range(1, len(ordered) + 1):
        last = ordered[max(0, end - window):end]
        points.append(WindowPoint(tasks=end, success_rate=sum(e.reward for e in last) / len(last),
                                  call_rate=sum(e.called for e in last) / len(last),
                                  policy_version=ordered[end - 1].policy_version))
    return points


def version_points(episodes: list[Episode]) -> list[VersionPoint]:
    """Success rate of the tasks whose final answer each policy version sampled."""
    grouped: dict[int, list[float]] = {}
    for e in episodes:
        if e.policy_version is not None:
            grouped.setdefault(e.policy_version, []).append(e.reward)
    return [VersionPoint(v, len(r), sum(r) / len(r)) for v, r in sorted(grouped.items())]


def _rate(episodes: list[Episode], field: str) -> float | None:
    return sum(float(getattr(e, field)) for e in episodes) / len(episodes) if episodes else None


def summarize(episodes: list[Episode], window: int, failed: int) -> dict:
    """The summary JSON: overall rates, first and last window, and both curves."""
    ordered = sorted(episodes, key=lambda e: e.finished_at)
    first, last = ordered[:window], ordered[-window:]
    return {
        "tasks": len(episodes), "failed_tasks": failed, "window": window,
        "success_rate": _rate(ordered, "reward"), "call_rate": _rate(ordered, "called"),
        "correct_call_rate": _rate(ordered, "call_correct"), "answer_correct_rate": _rate(ordered, "answer_correct"),
        "first_window_success_rate": _rate(first, "reward"), "last_window_success_rate": _rate(last, "reward"),
        "first_window_call_rate": _rate(first, "called"), "last_window_call_rate": _rate(last, "called"),
        "first_window_correct_call_rate": _rate(first, "call_correct"),
        "last_window_correct_call_rate": _rate(last, "call_correct"),
        "policy_versions": sorted({e.policy_version for e in episodes if e.policy_version is not None}),
        "points": [asdict(p) for p in window_points(ordered, window)],
        "by_version": [asdict(p) for p in version_points(ordered)],
    }


def plot_success(summary: dict, path: Path) -> None:
    """Rolling success and call rates over tasks (top) and success by policy version (bottom)."""
    fig = Figure(figsize=(9, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    points = summary["points"]
    x = [p["tasks"] for p in points]
    top.plot(x, [p["success_rate"] for p in points], label="success (judged final answer)")
    top.plot(x, [p["call_rate"] for p in points], label="called the tool", linestyle="--")
    top.set(xlabel="tasks finished", ylabel=f"rate over the last {summary['window']} tasks", ylim=(-0.02, 1.02))
    top.legend(loc="best", fontsize=8)
    versions = summary["by_version"]
    bottom.bar([v["policy_version"] for v in versions], [v["success_rate"] for v in versions], width=0.8)
    bottom.set(xlabel="policy version of the final answer", ylabel="success rate", ylim=(0, 1.02))
    fig.suptitle(f"agent: {summary['tasks']} calculator tasks, success {summary['success_rate'] or 0:.0%}")
    fig.savefig(path, dpi=100, format="png")  # the format named: a temporary name does not end in .png


PARTIAL_SUFFIX = ".partial"
"""The results are written under this suffix and renamed once both are whole: a run stopped while
writing them leaves no half file under a result's name."""


def write_results(episodes: list[Episode], window: int, failed: int, out: Path, extra: dict | None = None) -> dict:
    """``summary.json`` (with ``extra`` fields) and ``success.png`` in ``out``; returns the summary.
    ``summary.json`` is renamed into place last: it is there only when both are."""
    if not episodes:
        raise RuntimeError("no task finished: nothing to summarise")
    summary = {**summarize(episodes, window, failed), **(extra or {})}
    summary_partial, plot_partial = (out / f"{name}{PARTIAL_SUFFIX}" for name in (SUMMARY_FILE, PLOT_FILE))
    summary_partial.write_text(json.dumps(summary, indent=1) + "\n")
    plot_success(summary, plot_partial)
    plot_partial.replace(out / PLOT_FILE)
    summary_partial.replace(out / SUMMARY_FILE)
    return summary
