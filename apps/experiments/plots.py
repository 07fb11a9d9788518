"""The report's plots, from one or more seeds' runs (experiments/aggregate.py).

Curves over seeds are drawn as their mean with the pointwise 95% bootstrap band; a single
seed draws its own curve. Switch points are marked on each. matplotlib's object API only
(no pyplot, no global backend).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from apps.config import ExperimentConfig
from apps.experiments.aggregate import Band, Run, moving_reward_band, style_accuracy_band, style_share_curves

REWARDS_PNG, COMPARISON_PNG = "rewards_per_arm.png", "rewards_moving.png"
STYLE_SHARE_PNG, STYLE_PNG = "style_share.png", "style_accuracy.png"
PLOTS = {
    REWARDS_PNG: "reward per arm",
    COMPARISON_PNG: "moving reward of every arm",
    STYLE_SHARE_PNG: "share of each style among sampled answers",
    STYLE_PNG: "held-out style accuracy",
}
"""File name -> title of every plot the report shows."""


def mark_switches(ax, scenario: ExperimentConfig) -> None:
    for phase in scenario.schedule[1:]:
        ax.axvline(phase.from_rollout, color="grey", linestyle="--", linewidth=1)
        ax.text(phase.from_rollout, 1.0, f" {phase.style}", transform=ax.get_xaxis_transform(),
                va="top", fontsize=8, color="grey")


def draw_band(ax, b: Band, label: str, color: str | None = None, marker: str | None = None) -> None:
    line, = ax.plot(b.x, b.mean, label=label, color=color, marker=marker)
    if b.seeds.shape[0] > 1:
        ax.fill_between(b.x, b.low, b.high, color=line.get_color(), alpha=0.2, linewidth=0)


def plot_rewards_per_arm(runs: list[Run], arms: list[str], path: Path) -> None:
    scenario = runs[0].scenario
    w = scenario.metrics_window
    fig = Figure(figsize=(9, 2.4 * len(arms)), layout="constrained")
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    for ax, arm in zip(axes, arms):
        b = moving_reward_band(runs, arm, w)
        if b is None:
            continue
        if b.seeds.shape[0] == 1:
            rewards = [r.judge_value for run in runs if arm in run.arms for r in run.arms[arm].rewards]
            ax.scatter(range(len(rewards)), rewards, s=3, alpha=0.3, label="reward")
        else:
            for curve in b.seeds:
                ax.plot(b.x, curve, color="grey", linewidth=0.5, alpha=0.5)
        draw_band(ax, b, f"moving mean (W={w})" + (f", mean of {b.seeds.shape[0]} seeds" if b.seeds.shape[0] > 1
                                                   else ""), color="C1")
        mark_switches(ax, scenario)
        ax.set_title(arm, fontsize=10)
        ax.set(ylabel="reward", ylim=(-0.05, 1.05))
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("rollout")
    fig.savefig(path, dpi=100)


def plot_comparison(runs: list[Run], arms: list[str], path: Path) -> None:
    scenario = runs[0].scenario
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    for arm in arms:
        b = moving_reward_band(runs, arm, scenario.metrics_window)
        if b is not None:
            draw_band(ax, b, arm)
    mark_switches(ax, scenario)
    ax.axhline(scenario.realign_threshold, color="black", linestyle=":", linewidth=1)
    # the curve's window reaches back across a switch, the lag's does not: its crossing is no lag to read off
    ax.set_title(f"dotted: the re-alignment threshold; the lag table counts each phase's own rollouts, this "
                 f"curve's window of {scenario.metrics_window} reaches back across a switch", fontsize=8)
    ax.set(xlabel="rollout", ylabel=f"moving reward (W={scenario.metrics_window})", ylim=(-0.05, 1.05))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def plot_style_share(runs: list[Run], arms: list[str], path: Path) -> None:
    """Per arm, stacked: the share of each style among sampled answers per block of
    ``metrics_window`` rollouts (as the judge's classifier reads them), mean over seeds."""
    scenario = runs[0].scenario
    styles = list(scenario.styles)
    fig = Figure(figsize=(9, 2.4 * len(arms)), layout="constrained")
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    for ax, arm in zip(axes, arms):
        x, shares = style_share_curves(runs, arm, styles, scenario.metrics_window)
        if len(x):  # step="post" draws a block up to the next one's start: a closing point draws the last
            ends = [*x, x[-1] + scenario.metrics_window]
            ax.stackplot(ends, *([*shares[s], shares[s][-1]] for s in styles), labels=styles, step="post",
                         alpha=0.85)
        mark_switches(ax, scenario)
        ax.set_title(f"{arm} (preferred: " + ", ".join(p.style for p in scenario.schedule) + ")", fontsize=10)
        ax.set(ylabel="share of answers", ylim=(0, 1))
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes[-1].set_xlabel("rollout")
    fig.savefig(path, dpi=100)


def plot_style_accuracy(runs: list[Run], arms: list[str], path: Path) -> None:
    scenario = runs[0].scenario
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    for arm in arms:
        b = style_accuracy_band(runs, arm)
        if b is not None:
            draw_band(ax, b, arm, marker="o")
    mark_switches(ax, scenario)
    ax.set(xlabel="rollout", ylabel="held-out answers in the preferred style", ylim=(-0.05, 1.05))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def write_plots(runs: list[Run], arms: list[str], out_dir: Path) -> None:
    """Every plot of :data:`PLOTS` into ``out_dir``."""
    plot_rewards_per_arm(runs, arms, out_dir / REWARDS_PNG)
    plot_comparison(runs, arms, out_dir / COMPARISON_PNG)
    plot_style_share(runs, arms, out_dir / STYLE_SHARE_PNG)
    plot_style_accuracy(runs, arms, out_dir / STYLE_PNG)
