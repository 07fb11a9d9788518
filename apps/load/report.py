"""Results of a load run: one JSON file and a PNG plot (latency over time with the swap points)."""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from apps.load.stats import LoadResult, LoadSummary, percentile

PLOT_BUCKET_S = 5.0
"""Width of the time buckets of the plot's percentile lines and throughput bars."""
MIN_LAST_BUCKET_SHARE = 0.5
"""The run's last bucket is cut by its end; one narrower than this share of PLOT_BUCKET_S joins
the bucket before it, so that its rate (answers over its own width) rests on enough time."""


def result_json(result: LoadResult, summary: LoadSummary, extra: dict[str, Any] | None = None,
                include_requests: bool = True) -> dict[str, Any]:
    """Everything about a run as plain JSON data; ``extra`` adds sections (command, Kafka check)."""
    data: dict[str, Any] = {
        **(extra or {}),
        "url": result.url,
        "started_at": result.started_at,
        "params": dataclasses.asdict(result.params),
        "summary": dataclasses.asdict(summary),
        "served_versions": [[p.t_s, p.version] for p in result.versions],
        "version_poll_errors": result.version_poll_errors,
        "stopped_early": result.stopped_early,
        "stopped_at_s": result.stopped_at_s,
    }
    if include_requests:
        data["requests"] = [dataclasses.asdict(r) for r in result.records]
    return data


def write_results(path: Path, result: LoadResult, summary: LoadSummary, extra: dict[str, Any] | None = None,
                  include_requests: bool = True) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and the plot beside it (same name, .png); returns both paths."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_json(result, summary, extra, include_requests), indent=1) + "\n")
    png = path.with_suffix(".png")
    plot_latency(result, png)
    return path, png


@dataclasses.dataclass
class Bucket:
    """A span of the run and the answers that ended in it."""

    start_s: float
    end_s: float
    latencies: list[float] = dataclasses.field(default_factory=list)

    @property
    def mid_s(self) -> float:
        return (self.start_s + self.end_s) / 2

    @property
    def width_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def answers_per_s(self) -> float:
        return len(self.latencies) / self.width_s


def _bucket_edges(wall_s: float) -> list[float]:
    """0, PLOT_BUCKET_S, 2 PLOT_BUCKET_S, ... up to ``wall_s``, the last bucket cut at ``wall_s`` (it was
    drawn as a whole one: its answers over the full width, a drop in throughput that never happened)."""
    edges = [i * PLOT_BUCKET_S for i in range(math.ceil(wall_s / PLOT_BUCKET_S))] + [wall_s]
    if len(edges) > 2 and edges[-1] - edges[-2] < MIN_LAST_BUCKET_SHARE * PLOT_BUCKET_S:
        del edges[-2]
    return edges


def _buckets(result: LoadResult) -> list[Bucket]:
    """The run cut into buckets (:func:`_bucket_edges`), each with the latencies of the answers
    that ended in it."""
    edges = _bucket_edges(result.wall_s)
    out = [Bucket(start, end) for start, end in zip(edges, edges[1:])]
    for r in result.records:
        if r.kind != "feedback" and r.ok:
            i = min(bisect.bisect_right(edges, r.end_s) - 1, len(out) - 1)
            out[max(i, 0)].latencies.append(r.latency_s)
    return out


def plot_latency(result: LoadResult, path: Path) -> None:
    """Latency of every chat request over time (failures in red), p50/p99 per bucket, throughput,
    and a dashed line where the served policy version changed (as the version watcher saw it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 1])
    chats = [r for r in result.records if r.kind != "feedback"]
    for kind, colour in (("chat", "tab:blue"), ("stream", "tab:green")):
        ok = [r for r in chats if r.kind == kind and r.ok]
        top.scatter([r.end_s for r in ok], [r.latency_s for r in ok], s=4, alpha=0.35, color=colour,
                    label=f"{kind} ({len(ok)})")
    failed = [r for r in result.records if not r.ok]
    if failed:
        top.scatter([r.end_s for r in failed], [r.latency_s for r in failed], s=18, marker="x", color="red",
                    label=f"failed ({len(failed)})")
    buckets = _buckets(result)
    with_answers = [b for b in buckets if b.latencies]
    top.plot([b.mid_s for b in with_answers], [percentile(b.latencies, 50) for b in with_answers], color="black",
             label=f"p50 per {PLOT_BUCKET_S:.0f} s")
    top.plot([b.mid_s for b in with_answers], [percentile(b.latencies, 99) for b in with_answers], color="black",
             linestyle=":", label=f"p99 per {PLOT_BUCKET_S:.0f} s")
    bottom.bar([b.mid_s for b in buckets], [b.answers_per_s for b in buckets],
               width=[b.width_s * 0.9 for b in buckets], color="tab:gray")
    for i, point in enumerate(result.versions[1:]):
        for ax in (top, bottom):
            ax.axvline(point.t_s, color="tab:orange", linestyle="--", linewidth=0.8,
                       label="weights swapped" if (i == 0 and ax is top) else None)
    stop_s = result.stopped_at_s if result.stopped_at_s is not None else result.params.duration_s
    for ax in (top, bottom):
        ax.axvline(stop_s, color="tab:gray", linewidth=0.8,
                   label=("clients stopped early" if result.stopped_early else "clients stop sending")
                   if ax is top else None)
    top.set_ylabel("latency (s)")
    top.set_title(f"{result.params.clients} clients, {result.params.duration_s:.0f} s against {result.url}")
    top.legend(loc="upper left", fontsize=8, markerscale=2)
    bottom.set_ylabel("answered / s")
    bottom.set_xlabel("seconds since start (when each answer ended)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
