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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from apps.config import AppConfig, ExperimentConfig
from apps.experiments.aggregate import (ArmSummaryAcrossSeeds, NoResults, PhaseSummary, Run, load_runs,
                                       on_common_seeds, paired_difference, summarize, unfinished_runs)
from apps.experiments.gate_report import write_gate_report
from apps.experiments.intervals import cell
from apps.experiments.metrics import LEVEL_SHARE, lag_measurable
from apps.experiments.plots import PLOTS, write_plots
from apps.experiments.segments import write_segment_report
from online_sao.config import ConfigError

REPORT_FILE, JSON_FILE = "report.md", "report.json"

READING_FIELDS = ("reference_arm", "realign_threshold", "metrics_window", "collapse_fraction")
"""Scenario fields that decide how the report reads the results, not what an arm did: ``online-sao
report`` reads a run with the values its own configuration sets (:func:`reading_settings`)."""


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _phase_heads(arms: list[ArmSummaryAcrossSeeds]) -> list[str]:
    return [f"{p.style} {p.start}-{p.end - 1}" for p in arms[0].phases]


def _intro(scenario: ExperimentConfig, runs: list[Run], seeds: int) -> list[str]:
    schedule = ", ".join(f"{p.style} from rollout {p.from_rollout}" for p in scenario.schedule)
    used = ", ".join(str(run.scenario.seed) for run in runs if run.arms)  # a seed with no finished run is left out
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


def collapse_measured(a: ArmSummaryAcrossSeeds) -> int:
    """Seeds whose run was long enough for the collapse check (two windows)."""
    return sum(m.collapse.measurable for m in a.per_seed)


def lag_measured(a: ArmSummaryAcrossSeeds, phase: int, window: int) -> int:
    """Seeds whose phase ``phase`` holds a full window, so that a lag could be found in it."""
    return sum(lag_measurable(m.phases[phase].start, m.phases[phase].end, window) for m in a.per_seed)


def realign_measured(a: ArmSummaryAcrossSeeds, window: int) -> int:
    """Seeds whose every phase after a switch holds a full window."""
    return sum(all(lag_measurable(p.start, p.end, window) for p in m.phases[1:]) for m in a.per_seed)


def _count(hits: int, measured: int, seeds: int) -> str:
    """``hits/measured``; n/a when no seed could be measured, and the seeds that could not be, when some."""
    if not measured:
        return "n/a"
    return f"{hits}/{measured}" + ("" if measured == seeds else f", {seeds - measured} too short")


def _summary(arms: list[ArmSummaryAcrossSeeds], scenario: ExperimentConfig) -> list[str]:
    lines = ["## Summary", ""] + _table(
        ["arm", "seeds", "rollouts", "mean reward", "post-switch mean", "collapsed", "final held-out style acc.",
         "group wait (s)", "incomplete groups", "gate roll-backs", "drift restarts", "drift roll-backs"],
        [[a.name, str(a.seeds), str(a.rollouts), cell(a.mean_reward, of=a.seeds),
          cell(a.post_switch_mean, of=a.seeds), _count(a.collapsed, collapse_measured(a), a.seeds),
          cell(a.final_style_accuracy, of=a.seeds), cell(a.group_wait_s, 1, of=a.seeds),
          cell(a.incomplete_groups, 1, of=a.seeds), cell(a.rollbacks, 1, of=a.seeds),
          cell(a.drift_restarts, 1, of=a.seeds), cell(a.drift_rollbacks, 1, of=a.seeds)] for a in arms])
    if any(collapse_measured(a) < a.seeds for a in arms):
        lines += ["", f"Collapsed: n/a, or counted over fewer seeds (\"too short\"), where a run is shorter than "
                      f"two windows ({2 * scenario.metrics_window} rollouts): too short to tell."]
    return lines


def _lag_cell(a: ArmSummaryAcrossSeeds, k: int, window: int) -> str:
    measured = lag_measured(a, k, window)
    phase = a.phases[k]
    return f"{cell(phase.lag, 0)} ({_count(phase.lag_reached, measured, a.seeds)})" if measured else "n/a"


def _phase_table(title: str, arms: list[ArmSummaryAcrossSeeds], heads: list[str],
                 render: Callable[[ArmSummaryAcrossSeeds, PhaseSummary], str]) -> list[str]:
    return ["", f"## {title}", ""] + _table(["arm", *heads], [[a.name, *(render(a, p) for p in a.phases)]
                                                             for a in arms])


def _lags(arms: list[ArmSummaryAcrossSeeds], scenario: ExperimentConfig, heads: list[str]) -> list[str]:
    window = scenario.metrics_window
    lines = ["", f"## Re-alignment lag (rollouts to a moving reward of {scenario.realign_threshold})", ""] + _table(
        ["arm", *heads, "after every switch"],  # seeds re-aligned in all post-switch phases
        [[a.name, *(_lag_cell(a, k, window) for k in range(len(a.phases))),
          _count(a.realigned, realign_measured(a, window), a.seeds)] for a in arms])
    if any(lag_measured(a, k, window) < a.seeds for a in arms for k in range(len(a.phases))):
        lines += ["", f"Lag: n/a, or counted over fewer seeds (\"too short\"), where a phase is shorter than the "
                      f"window (W={window}): it has no moving reward of its own rollouts to reach the threshold."]
    return lines


def markdown(arms: list[ArmSummaryAcrossSeeds], runs: list[Run], read_with: Sequence[str] = ()) -> str:
    """The report; ``read_with`` names the report's reading settings that are not the run's."""
    scenario = runs[0].scenario
    seeds = max(a.seeds for a in arms)
    lines = _intro(scenario, runs, seeds)
    if read_with:
        lines += [f"**Read with other settings than the run's** (this command's configuration): "
                  f"{'; '.join(read_with)}.", ""]
    left = unfinished_runs(runs)
    if left:
        lines += [f"**Left out, not finished** (under way, or cut short: `simulate --resume` runs them again): "
                  f"{'; '.join(left)}. The seeds column counts the finished runs.", ""]
    lines += _summary(arms, scenario)
    heads = _phase_heads(arms)
    lines += _phase_table("Level (mean reward of each phase's last quarter)", arms, heads,
                          lambda a, p: cell(p.level, of=a.seeds))
    lines += _lags(arms, scenario, heads)
    lines += _phase_table("Area (mean reward over each phase)", arms, heads, lambda a, p: cell(p.area, of=a.seeds))
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


def log_to_mlflow(out_dir: Path, arms: list[ArmSummaryAcrossSeeds], uri: str, experiment: str, run_name: str,
                  artifact_location: str | None = None, window: int | None = None) -> str:
    """One MLflow run holding the report directory as artifacts and each arm's mean measures; returns its id.
    ``artifact_location``: where the experiment keeps artifacts if this creates it (the learner's,
    trainer.mlflow_store.artifact_root); an existing experiment keeps its own. ``window``: the runs'
    ``metrics_window``, for the seeds a re-alignment could be measured on (not logged without it)."""
    from trainer.mlflow_store import experiment_id, open_client  # MLflow loads only when a report logs

    client = open_client(uri)
    run_id = client.create_run(experiment_id(client, experiment, artifact_location), run_name=run_name).info.run_id
    for a in arms:
        values = {"mean_reward": a.mean_reward, "post_switch_mean": a.post_switch_mean}
        for p in a.phases:
            values[f"level_{p.start}"] = p.level
            values[f"area_{p.start}"] = p.area
            values[f"lag_{p.start}"] = p.lag
        for key, value in values.items():
            if value is not None:
                client.log_metric(run_id, f"{a.name}.{key}", value.mean)
        # with the seeds each could be measured on: 0 of 0 is not "never" (report.md reads n/a)
        client.log_metric(run_id, f"{a.name}.collapsed_seeds", float(a.collapsed))
        client.log_metric(run_id, f"{a.name}.collapse_measured_seeds", float(collapse_measured(a)))
        client.log_metric(run_id, f"{a.name}.realigned_seeds", float(a.realigned))
        if window is not None:
            client.log_metric(run_id, f"{a.name}.realign_measured_seeds", float(realign_measured(a, window)))
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
    artifact_location: str | None = None
    """Where the experiment keeps artifacts if the report creates it: the learner's (``<data_dir>/
    mlflow-artifacts`` beside a SQLite store). Without it MLflow chose ``./mlruns`` of the current
    directory, for the report's artifacts and every later run's of that experiment."""

    @classmethod
    def of(cls, cfg: AppConfig) -> MlflowTarget:
        """The configuration's ``mlflow.tracking_uri`` (or its default), ``mlflow.experiment`` and artifact root."""
        from trainer.mlflow_store import artifact_root  # MLflow loads only when a report logs

        return cls(cfg.mlflow_uri, cfg.mlflow.experiment, artifact_root(cfg))


def reading_settings(exp: ExperimentConfig) -> dict[str, Any]:
    """The :data:`READING_FIELDS` that ``exp`` sets itself (configuration file, environment or ``--set``):
    what ``online-sao report`` reads a run with instead of the run's own values. Those left at their
    defaults are the run's."""
    return {name: getattr(exp, name) for name in READING_FIELDS if name in exp.model_fields_set}


def _read_with(runs: list[Run], reading: Mapping[str, Any]) -> tuple[list[Run], list[str]]:
    """``runs`` with ``reading``'s values in their scenarios, and ``experiment.<field> <value> (the run's:
    <value>)`` for each that differs from the run's."""
    if set(reading) - set(READING_FIELDS):
        raise ValueError(f"not report settings: {sorted(set(reading) - set(READING_FIELDS))}")
    own = runs[0].scenario
    differing = [f"experiment.{name} {value} (the run's: {getattr(own, name)})" for name, value in reading.items()
                 if value != getattr(own, name)]
    return [replace(run, scenario=run.scenario.model_copy(update=dict(reading))) for run in runs], differing


def write_report(results_dir: Path, out_dir: Path, mlflow: MlflowTarget | None = None,
                 reading: Mapping[str, Any] | None = None) -> Path:
    """Write the report of ``results_dir`` into ``out_dir`` (and to MLflow when ``mlflow`` is given).
    ``reading``: :data:`READING_FIELDS` to read the runs with instead of their ``scenario.json``'s
    (``online-sao report``; ``simulate`` reports its run with its own); the report names those that differ."""
    runs, read_with = _read_with(load_runs(results_dir), reading or {})
    arms = summarize(runs)
    reference = (reading or {}).get("reference_arm")
    if reference is not None and reference not in {a.name for a in arms}:
        raise ConfigError(f"experiment.reference_arm {reference!r}: {results_dir} has no finished run of it "
                          f"(its arms: {', '.join(a.name for a in arms)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_plots(runs, [a.name for a in arms], out_dir)
    (out_dir / JSON_FILE).write_text(json.dumps([asdict(a) for a in arms], indent=2) + "\n")
    path = out_dir / REPORT_FILE
    names = [a.name for a in arms]
    sections = write_segment_report(runs, names, out_dir) + write_gate_report(runs, names, out_dir)
    path.write_text(markdown(arms, runs, read_with) + "\n".join(sections))
    if mlflow is not None:
        log_to_mlflow(out_dir, arms, mlflow.uri, mlflow.experiment, f"{runs[0].scenario.name}-report",
                      mlflow.artifact_location, window=runs[0].scenario.metrics_window)
    return path


def run_report_cli(cfg: AppConfig) -> int:
    """``online-sao report``: report of ``<results_dir>`` into ``<results_dir>/report``, logged to MLflow;
    read with the :data:`READING_FIELDS` the configuration sets (:func:`reading_settings`)."""
    from apps.experiments.scenario import results_dir

    source = results_dir(cfg)
    try:
        path = write_report(source, source / "report", MlflowTarget.of(cfg), reading_settings(cfg.experiment))
    except NoResults as exc:
        print(f"online-sao: {exc}\n(`online-sao simulate` writes results, with --resume it finishes runs cut short; "
              "the report reads experiment.results_dir, default <data_dir>/experiments/<experiment.name>)",
              file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0
