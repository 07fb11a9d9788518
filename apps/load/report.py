"""Results of a load run: one JSON file and a PNG plot (latency over time with the swap points)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from apps.load.stats import LoadResult, LoadSummary, percentile

PLOT_BUCKET_S = 5.0
"""Width of the time buckets of the plot's percentile lines and throughput bars."""


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


def _buckets(result: LoadResult) -> list[tuple[float, list[float], int]]:
    """(bucket middle, latencies of answers ending in it, answers in it) per PLOT_BUCKET_S."""
    answered = [r for r in result.records if r.kind != "feedback" and r.ok]
    count = int(result.wall_s // PLOT_BUCKET_S) + 1
    out: list[tuple[float, list[float], int]] = [((i + 0.5) * PLOT_BUCKET_S, [], 0) for i in range(count)]
    for r in answered:
        i = min(int(r.end_s // PLOT_BUCKET_S), count - 1)
        mid, lat, n = out[i]
        lat.append(r.latency_s)
        out[i] = (mid, lat, n + 1)
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
    with_answers = [(mid, lat) for mid, lat, _ in buckets if lat]
    top.plot([m for m, _ in with_answers], [percentile(lat, 50) for _, lat in with_answers], color="black",
             label=f"p50 per {PLOT_BUCKET_S:.0f} s")
    top.plot([m for m, _ in with_answers], [percentile(lat, 99) for _, lat in with_answers], color="black",
             linestyle=":", label=f"p99 per {PLOT_BUCKET_S:.0f} s")
    bottom.bar([mid for mid, _, _ in buckets], [n / PLOT_BUCKET_S for _, _, n in buckets], width=PLOT_BUCKET_S * 0.9,
               color="tab:gray")
    for i, point in enumerate(result.versions[1:]):
        for ax in (top, bottom):
            ax.axvline(point.t_s, color="tab:orange", linestyle="--", linewidth=0.8,
                       label="weights swapped" if (i == 0 and ax is top) else None)
    for ax in (top, bottom):
        ax.axvline(result.params.duration_s, color="tab:gray", linewidth=0.8,
                   label="clients stop sending" if ax is top else None)
    top.set_ylabel("latency (s)")
    top.set_title(f"{result.params.clients} clients, {result.params.duration_s:.0f} s against {result.url}")
    top.legend(loc="upper left", fontsize=8, markerscale=2)
    bottom.set_ylabel("answered / s")
    bottom.set_xlabel("seconds since start (when each answer ended)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
