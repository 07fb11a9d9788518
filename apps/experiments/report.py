"""``online-sao report``: the experiment's Markdown report, PNG plots and MLflow artifacts.

Reads a results directory (experiments/results.py), computes the metrics of
experiments/metrics.py per arm and writes ``report.md``, ``report.json`` and three
plots into ``out_dir``: every arm's reward (raw and moving average), the arms'
moving rewards on one chart, and held-out style accuracy; switch points are
marked on each. Plots use matplotlib's object API (no pyplot, no global backend).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from apps.config import AppConfig, ExperimentConfig
from apps.experiments.metrics import Collapse, SwitchMetrics, detect_collapse, moving_average, switch_metrics
from apps.experiments.results import ArmResults, read_arm, read_scenario

REPORT_FILE, JSON_FILE = "report.md", "report.json"
REWARDS_PNG, COMPARISON_PNG, STYLE_PNG = "rewards_per_arm.png", "rewards_moving.png", "style_accuracy.png"


@dataclass(frozen=True)
class ArmReport:
    name: str
    rollouts: int
    mean_reward: float | None
    switches: list[SwitchMetrics]
    collapse: Collapse
    final_style_accuracy: float | None
    group_wait_s: float | None


def arm_report(arm: ArmResults, scenario: ExperimentConfig) -> ArmReport:
    rewards = [r.reward for r in arm.rewards]
    quality = [r.quality for r in arm.rewards]
    w = scenario.metrics_window
    switches = switch_metrics(rewards, scenario.switch_rollouts, w) if rewards else []
    collapse = detect_collapse(rewards, quality, w, scenario.collapse_fraction)
    return ArmReport(
        name=arm.name, rollouts=len(rewards), mean_reward=sum(rewards) / len(rewards) if rewards else None,
        switches=switches, collapse=collapse,
        final_style_accuracy=arm.evals[-1].style_accuracy if arm.evals else None,
        group_wait_s=arm.summary.group_wait_s if arm.summary else None)


def _mark_switches(ax, scenario: ExperimentConfig) -> None:
    for phase in scenario.schedule[1:]:
        ax.axvline(phase.from_rollout, color="grey", linestyle="--", linewidth=1)
        ax.text(phase.from_rollout, 1.0, f" {phase.style}", transform=ax.get_xaxis_transform(),
                va="top", fontsize=8, color="grey")


def plot_rewards_per_arm(arms: list[ArmResults], scenario: ExperimentConfig, path: Path) -> None:
    fig = Figure(figsize=(9, 2.4 * len(arms)), layout="constrained")
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    for ax, arm in zip(axes, arms):
        rewards = [r.reward for r in arm.rewards]
        ax.scatter(range(len(rewards)), rewards, s=3, alpha=0.3, label="reward")
        ax.plot(moving_average(rewards, scenario.metrics_window), color="C1",
                label=f"moving mean (W={scenario.metrics_window})")
        _mark_switches(ax, scenario)
        ax.set_title(arm.name, fontsize=10)
        ax.set_ylabel("reward")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("rollout")
    fig.savefig(path, dpi=100)


def plot_comparison(arms: list[ArmResults], scenario: ExperimentConfig, path: Path) -> None:
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    for arm in arms:
        ax.plot(moving_average([r.reward for r in arm.rewards], scenario.metrics_window), label=arm.name)
    _mark_switches(ax, scenario)
    ax.set(xlabel="rollout", ylabel=f"moving reward (W={scenario.metrics_window})", ylim=(-0.05, 1.05))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def plot_style_accuracy(arms: list[ArmResults], scenario: ExperimentConfig, path: Path) -> None:
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    for arm in arms:
        ax.plot([e.rollout for e in arm.evals], [e.style_accuracy for e in arm.evals], marker="o", label=arm.name)
    _mark_switches(ax, scenario)
    ax.set(xlabel="rollout", ylabel="held-out answers in the preferred style", ylim=(-0.05, 1.05))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def _num(value: float | int | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def markdown(reports: list[ArmReport], scenario: ExperimentConfig) -> str:
    switches = scenario.switch_rollouts
    schedule = ", ".join(f"{p.style} from rollout {p.from_rollout}" for p in scenario.schedule)
    head = ["arm", "rollouts", "mean reward"]
    for s in switches:
        head += [f"lag @{s}", f"level @{s}"]
    head += ["collapse", "final style acc.", "group wait (s)"]
    lines = [f"# Drifting style preferences: {scenario.name}", "",
             f"Schedule: {schedule}. Seed {scenario.seed}, {scenario.rollouts_per_arm} rollouts per arm, "
             f"{scenario.requests_per_second} requests/s, concurrency {scenario.concurrency}, "
             f"reward delay {scenario.reward_delay_s} s, drop rate {scenario.drop_rate}.", "",
             f"Lag: rollouts after a switch until the moving reward (W={scenario.metrics_window}, post-switch "
             f"rollouts only) is back at 90% of its level before the switch ('-': not within the phase). "
             f"Level: mean reward of the phase's last {scenario.metrics_window} rollouts. Collapse: the moving "
             f"answer quality stays below {scenario.collapse_fraction:.0%} of its first window to the end "
             f"(or a non-finite reward).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reports:
        by_switch = {m.switch: m for m in r.switches}
        row = [r.name, str(r.rollouts), _num(r.mean_reward)]
        for s in switches:
            m = by_switch.get(s)
            row += [_num(m.lag if m else None), _num(m.level if m else None)]
        collapse = f"yes (rollout {r.collapse.at_rollout})" if r.collapse.collapsed else "no"
        row += [collapse, _num(r.final_style_accuracy), _num(r.group_wait_s, 1)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"![rewards per arm]({REWARDS_PNG})", "", f"![moving rewards]({COMPARISON_PNG})", "",
              f"![held-out style accuracy]({STYLE_PNG})", ""]
    return "\n".join(lines)


def log_to_mlflow(out_dir: Path, reports: list[ArmReport], uri: str, experiment: str, run_name: str) -> str:
    """One MLflow run holding the report directory as artifacts and each arm's metrics; returns its id."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    run = client.create_run(experiment_id, run_name=run_name)
    run_id = run.info.run_id
    for r in reports:
        if r.mean_reward is not None:
            client.log_metric(run_id, f"{r.name}.mean_reward", r.mean_reward)
        client.log_metric(run_id, f"{r.name}.collapsed", float(r.collapse.collapsed))
        for m in r.switches:
            if m.lag is not None:
                client.log_metric(run_id, f"{r.name}.lag_at_{m.switch}", m.lag)
            if m.level is not None:
                client.log_metric(run_id, f"{r.name}.level_at_{m.switch}", m.level)
    client.log_artifacts(run_id, str(out_dir), artifact_path="report")
    client.set_terminated(run_id)
    return run_id


def write_report(results_dir: Path, out_dir: Path, mlflow_uri: str | None = None,
                 mlflow_experiment: str = "online-sao") -> Path:
    """Write the report of ``results_dir`` into ``out_dir`` (and MLflow when a URI is given)."""
    scenario = read_scenario(results_dir)
    arms = [read_arm(p) for p in sorted(results_dir.glob("*.jsonl"))]
    if not arms:
        raise FileNotFoundError(f"no per-arm results (*.jsonl) in {results_dir}")
    order = {a.name: i for i, a in enumerate(scenario.arms)}
    arms.sort(key=lambda a: (order.get(a.name, len(order)), a.name))
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = [arm_report(a, scenario) for a in arms]
    plot_rewards_per_arm(arms, scenario, out_dir / REWARDS_PNG)
    plot_comparison(arms, scenario, out_dir / COMPARISON_PNG)
    plot_style_accuracy(arms, scenario, out_dir / STYLE_PNG)
    (out_dir / JSON_FILE).write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    path = out_dir / REPORT_FILE
    path.write_text(markdown(reports, scenario))
    if mlflow_uri is not None:
        log_to_mlflow(out_dir, reports, mlflow_uri, mlflow_experiment, f"{scenario.name}-report")
    return path


def run_report_cli(cfg: AppConfig) -> int:
    """``online-sao report``: report of ``<results_dir>`` into ``<results_dir>/report``, logged to MLflow."""
    from apps.experiments.scenario import results_dir

    source = results_dir(cfg)
    path = write_report(source, source / "report", cfg.mlflow_uri, cfg.mlflow.experiment)
    print(path, flush=True)
    return 0
