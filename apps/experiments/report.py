"""``online-sao report``: the experiment's Markdown report, PNG plots and MLflow artifacts.

Reads a results directory -- one run, or one run per seed (experiments/aggregate.py) --
and writes ``report.md``, ``report.json`` and the plots (experiments/plots.py) into
``out_dir``, with the registry's decisions of live arms from MLflow (experiments/gate_report.py).
Every measure is given as its mean over seeds with a 95% bootstrap interval in brackets (no
interval with one seed).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from apps.config import AppConfig, ExperimentConfig
from apps.experiments.aggregate import (ArmSummaryAcrossSeeds, NoResults, Run, load_runs, on_common_seeds,
                                       paired_difference, summarize, unfinished_runs)
from apps.experiments.gate_report import write_gate_report
from apps.experiments.intervals import cell
from apps.experiments.metrics import LEVEL_SHARE
from apps.experiments.plots import PLOTS, write_plots
from apps.experiments.segments import write_segment_report

REPORT_FILE, JSON_FILE = "report.md", "report.json"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _phase_heads(arms: list[ArmSummaryAcrossSeeds]) -> list[str]:
    return [f"{p.style} {p.start}-{p.end - 1}" for p in arms[0].phases]


def _intro(scenario: ExperimentConfig, runs: list[Run], seeds: int) -> list[str]:
    schedule = ", ".join(f"{p.style} from rollout {p.from_rollout}" for p in scenario.schedule)
    used = ", ".join(str(run.scenario.seed) for run in runs)
    return [
        f"# Drifting style preferences: {scenario.name}", "",
        f"Schedule: {schedule}. {scenario.rollouts_per_arm} rollouts per arm, {scenario.requests_per_second} "
        f"requests/s, concurrency {scenario.concurrency}, reward delay {scenario.reward_delay_s} s, drop rate "
        f"{scenario.drop_rate}. Driver: {scenario.driver}. Seeds: {seeds} (experiment.seed {used}; "
        f"prompt and learner seeds shifted alike).", "",
        "Each number is the mean over seeds" + (", with its 95% percentile-bootstrap interval over seeds in "
                                                "brackets" if seeds > 1 else "") + ". "
        f"Level: mean reward of the phase's last {LEVEL_SHARE:.0%}. Lag: rollouts from the phase's start until "
        f"the moving reward (W={scenario.metrics_window}, rollouts of the phase only) first reaches "
        f"{scenario.realign_threshold} -- the same absolute threshold for every arm; the mean is over the seeds "
        f"that reached it (how many in parentheses; *after every switch*: the seeds that reached it in every "
        f"phase after a switch). Area: the area under the phase's reward curve per rollout "
        f"(its mean reward). Post-switch mean: mean reward from the first switch to the end. Collapse: the "
        f"moving answer quality stays below {scenario.collapse_fraction:.0%} of its first window to the end. Gate "
        f"roll-backs: candidates the registry's gate or monitors rolled back (live only); drift restarts and "
        f"roll-backs: what the learner's drift detector did (`drift.*`; '-' in files from before they were "
        f"counted).", "",
        "Held-out style accuracy and the style shares are measured with the judge's own style classifier, the "
        "one that makes the reward: they show what the reward sees, not an independent judgement of style.", "",
        *_raters(scenario)]


def _raters(scenario: ExperimentConfig) -> list[str]:
    if not scenario.rater_scale and not scenario.rater_offset:
        return []
    factors = ", ".join(f"{topic} {factor:g}" for topic, factor in scenario.rater_scale.items()) or "none"
    shifts = ", ".join(f"{topic} {shift:+g}" for topic, shift in scenario.rater_offset.items()) or "none"
    return ["Raters rate on scales of their own: the learners received the judge's value times the factor of "
            f"the prompt's topic, plus its shift (factors: {factors}; shifts: {shifts}; 1 and 0 for any other "
            "topic). Every reward figure here is the judge's own value (quality x style), before factor and "
            "shift.", ""]


def markdown(arms: list[ArmSummaryAcrossSeeds], runs: list[Run]) -> str:
    scenario = runs[0].scenario
    seeds = max(a.seeds for a in arms)
    lines = _intro(scenario, runs, seeds)
    left = unfinished_runs(runs)
    if left:
        lines += [f"**Left out, not finished** (under way, or cut short: `simulate --resume` runs them again): "
                  f"{'; '.join(left)}. The seeds column counts the finished runs.", ""]
    lines += ["## Summary", ""] + _table(
        ["arm", "seeds", "rollouts", "mean reward", "post-switch mean", "collapsed", "final held-out style acc.",
         "group wait (s)", "incomplete groups", "gate roll-backs", "drift restarts", "drift roll-backs"],
        [[a.name, str(a.seeds), str(a.rollouts), cell(a.mean_reward, of=a.seeds),
          cell(a.post_switch_mean, of=a.seeds), f"{a.collapsed}/{a.seeds}", cell(a.final_style_accuracy, of=a.seeds),
          cell(a.group_wait_s, 1, of=a.seeds), cell(a.incomplete_groups, 1, of=a.seeds),
          cell(a.rollbacks, 1, of=a.seeds), cell(a.drift_restarts, 1, of=a.seeds),
          cell(a.drift_rollbacks, 1, of=a.seeds)] for a in arms])
    heads = _phase_heads(arms)
    every_switch = ("after every switch", lambda a: f"{a.realigned}/{a.seeds}")  # seeds re-aligned in all post-switch phases
    for title, render, extra in (
            ("Level (mean reward of each phase's last quarter)", lambda a, p: cell(p.level, of=a.seeds), None),
            (f"Re-alignment lag (rollouts to a moving reward of {scenario.realign_threshold})",
             lambda a, p: f"{cell(p.lag, 0)} ({p.lag_reached}/{a.seeds})", every_switch),
            ("Area (mean reward over each phase)", lambda a, p: cell(p.area, of=a.seeds), None)):
        lines += ["", f"## {title}", ""] + _table(
            ["arm", *heads, *([extra[0]] if extra else [])],
            [[a.name, *(render(a, p) for p in a.phases), *([extra[1](a)] if extra else [])] for a in arms])
    lines += _comparison(arms, runs, scenario.reference_arm)
    lines += [""] + [f"![{title}]({name})\n" for name, title in PLOTS.items()]
    return "\n".join(lines)


def _comparison(arms: list[ArmSummaryAcrossSeeds], runs: list[Run], reference: str | None) -> list[str]:
    ref = next((a for a in arms if a.name == reference), None)
    if ref is None or ref.post_switch_mean is None or len(arms) < 2:
        return []
    rows = []
    for a in arms:
        if a is ref or a.post_switch_mean is None:
            continue
        # both sides over the seeds both arms have: a seed only one of them ran would move its mean alone
        ref_common, arm_common = on_common_seeds(runs, ref.name, a.name)
        if ref_common is None or arm_common is None:
            diff, apart = "-", "- (no seed in common)"
        else:
            seeds = max(ref.seeds, a.seeds)
            diff = f"{ref_common.mean - arm_common.mean:+.3f}" + (
                "" if ref_common.n >= seeds else f" ({ref_common.n} seeds in common of {seeds})")
            if ref_common.n < 2:
                apart = "- (one seed: no interval)"  # a single seed's "interval" is a point: any difference would look apart
            else:
                apart = "yes" if ref_common.apart_from(arm_common) else "no"
        paired = paired_difference(runs, ref.name, a.name)
        excludes = "-" if paired is None or paired.n < 2 else ("yes" if paired.low > 0 or paired.high < 0 else "no")
        rows.append([a.name, cell(a.post_switch_mean, of=a.seeds), diff, apart,
                     cell(paired, signed=True, of=max(a.seeds, ref.seeds)), excludes])
    return ["", f"## {ref.name} against each arm (post-switch mean reward {cell(ref.post_switch_mean, of=ref.seeds)})", "",
            *_table(["arm", "post-switch mean", f"{ref.name} minus arm", "95% intervals apart",
                     "minus arm, paired by seed", "paired interval excludes 0"], rows),
            "", "Paired by seed: the mean over seeds of each seed's difference, with its 95% bootstrap interval "
            "(every arm of a seed gets the same traffic)."]


def log_to_mlflow(out_dir: Path, arms: list[ArmSummaryAcrossSeeds], uri: str, experiment: str, run_name: str) -> str:
    """One MLflow run holding the report directory as artifacts and each arm's mean measures; returns its id."""
    from trainer.mlflow_store import experiment_id, open_client  # MLflow loads only when a report logs

    client = open_client(uri)
    run_id = client.create_run(experiment_id(client, experiment), run_name=run_name).info.run_id
    for a in arms:
        values = {"mean_reward": a.mean_reward, "post_switch_mean": a.post_switch_mean}
        for p in a.phases:
            values[f"level_{p.start}"] = p.level
            values[f"area_{p.start}"] = p.area
            values[f"lag_{p.start}"] = p.lag
        for key, value in values.items():
            if value is not None:
                client.log_metric(run_id, f"{a.name}.{key}", value.mean)
        client.log_metric(run_id, f"{a.name}.collapsed_seeds", float(a.collapsed))
        client.log_metric(run_id, f"{a.name}.realigned_seeds", float(a.realigned))
    client.log_artifacts(run_id, str(out_dir), artifact_path="report")
    client.set_terminated(run_id)
    return run_id


@dataclass(frozen=True)
class MlflowTarget:
    """Where a report is logged: a tracking URI and an experiment, both given (a default experiment,
    "online-sao", sent the reports of ``simulate`` and ``lr-sweep`` there whatever ``mlflow.experiment``
    said, while ``online-sao report`` logged to the configured one)."""

    uri: str
    experiment: str

    @classmethod
    def of(cls, cfg: AppConfig) -> MlflowTarget:
        """The configuration's ``mlflow.tracking_uri`` (or its default) and ``mlflow.experiment``."""
        return cls(cfg.mlflow_uri, cfg.mlflow.experiment)


def write_report(results_dir: Path, out_dir: Path, mlflow: MlflowTarget | None = None) -> Path:
    """Write the report of ``results_dir`` into ``out_dir`` (and to MLflow when ``mlflow`` is given)."""
    runs = load_runs(results_dir)
    arms = summarize(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_plots(runs, [a.name for a in arms], out_dir)
    (out_dir / JSON_FILE).write_text(json.dumps([asdict(a) for a in arms], indent=2) + "\n")
    path = out_dir / REPORT_FILE
    names = [a.name for a in arms]
    sections = write_segment_report(runs, names, out_dir) + write_gate_report(runs, names, out_dir)
    path.write_text(markdown(arms, runs) + "\n".join(sections))
    if mlflow is not None:
        log_to_mlflow(out_dir, arms, mlflow.uri, mlflow.experiment, f"{runs[0].scenario.name}-report")
    return path


def run_report_cli(cfg: AppConfig) -> int:
    """``online-sao report``: report of ``<results_dir>`` into ``<results_dir>/report``, logged to MLflow."""
    from apps.experiments.scenario import results_dir

    source = results_dir(cfg)
    try:
        path = write_report(source, source / "report", MlflowTarget.of(cfg))
    except NoResults as exc:
        print(f"online-sao: {exc}\n(`online-sao simulate` writes results, with --resume it finishes runs cut short; "
              "the report reads experiment.results_dir, default <data_dir>/experiments/<experiment.name>)",
              file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0
