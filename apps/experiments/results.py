"""Files of one experiment run, written by the judge and the evaluation, read by the report.

Layout of a results directory:

* ``scenario.json`` -- the ExperimentConfig the run used (schedule, window, seeds).
* ``<arm>.jsonl`` -- one JSON object per line: a :class:`RewardRow` for every judged
  rollout, an :class:`EvalRow` for every held-out style measurement and (in-process
  driver) a :class:`StepRow` for every learner step.
* ``<arm>.summary.json`` -- an :class:`ArmSummary` either driver writes when an arm ends
  (traffic counts, learner steps, grpo's group counters from the reward join, the settings and the
  scenario it ran with) and deletes before an arm starts, so it marks a finished run of the
  directory's scenario.

A run of several seeds (``online-sao simulate --seeds N``) keeps one such directory per
seed, ``seed-<k>/``, under the scenario's results directory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from apps.config import ExperimentConfig
from online_sao.config import ConfigError

SCENARIO_FILE = "scenario.json"


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RewardRow(_Row):
    """One judged rollout (the score is recorded whether or not the reward was delivered)."""

    # a non-finite value would be written as null, which no reader takes back: refuse it when written
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["reward"] = "reward"
    rollout: int = Field(ge=0)
    """0-based count of judged rollouts of the arm (the schedule's clock)."""
    t: float
    """Unix time of judging."""
    version: int = Field(ge=0)
    """Newest policy version that sampled the answer."""
    reward: float
    """What the learner receives: the judge's value times ``rater_scale`` plus ``rater_offset``."""
    quality: float
    style: float
    preferred: str
    rater_scale: float = Field(1.0, gt=0)
    """The factor the prompt's raters put on the judge's value (``experiment.rater_scale``; 1 in
    older files)."""
    rater_offset: float = 0.0
    """The shift the prompt's raters add after the factor (``experiment.rater_offset``; 0 in older
    files)."""
    delivered: bool = True
    """False when the judge dropped the reward (experiment.drop_rate)."""
    interaction_id: str | None = None
    sampled_style: str | None = None
    """The style the judge's classifier finds most likely in the answer (None in older files)."""
    segment: str | None = None
    """The user segment the request came from (experiment.segments; None without segments)."""

    @property
    def judge_value(self) -> float:
        """The judge's own value (quality x style), before the raters' scale and shift: what the report's
        levels, lags and areas measure."""
        return (self.reward - self.rater_offset) / self.rater_scale

    def scores(self) -> dict[str, float]:
        """What the reward record carries besides its value (``Reward.scores``): the judge's
        quality and style, for the learner's quality monitor and per-segment books."""
        return {"quality": self.quality, "style": self.style}


class EvalRow(_Row):
    """Held-out style accuracy measured at a rollout count."""

    kind: Literal["eval"] = "eval"
    rollout: int = Field(ge=0)
    t: float
    version: int = Field(ge=0)
    style_accuracy: float = Field(ge=0, le=1)
    """Share of held-out prompts answered in the preferred style (by the style classifier)."""
    preferred: str
    prompts: int = Field(ge=1)


class StepRow(_Row):
    """One learner step of the in-process driver."""

    kind: Literal["step"] = "step"
    step: int = Field(ge=1)
    rollout: int = Field(ge=0)
    """Rollouts judged when the step ran."""
    version: int = Field(ge=0)
    """Policy version after the step."""
    metrics: dict[str, float]
    """What the learning rule returned (value loss, explained variance, kept share, ...)."""


ResultRow = Annotated[Union[RewardRow, EvalRow, StepRow], Field(discriminator="kind")]
_ROW = TypeAdapter(ResultRow)


class ArmSummary(_Row):
    name: str
    driver: Literal["live", "inprocess"]
    answered: int
    failed: int = 0
    wall_s: float
    """Seconds the arm took, start-up included."""
    traffic_s: float
    """Seconds from the first to the last simulated request's answer."""
    learner_steps: int | None = None
    """Steps the learner ran (None: the live learner's MLflow run was not found)."""
    complete_groups: int | None = None
    """grpo: groups trained on with all their members (reward join counters)."""
    incomplete_groups: int | None = None
    """grpo: groups trained on short of members after ``reward.group_timeout_s``."""
    group_wait_s: float | None = None
    """grpo: mean record-time seconds from a group's first member being ready to the group being
    handed to a step (complete or timed out)."""
    rollbacks: int | None = None
    """Candidates the registry's gate or monitors rolled back (live learner; the in-process driver
    has no registry)."""
    drift_restarts: int | None = None
    """Times the drift detector restarted the learner from its starting weights (``drift.enabled``;
    None in files written before it was counted)."""
    drift_rollbacks: int | None = None
    """Times the drift detector rolled the learner back instead, on probation (``drift.rollback_first``)."""
    value_pretraining: dict[str, float] = {}
    """What value pre-training of the critic reported (explained variance before and after, ...);
    empty without pre-training (the live learner's are in MLflow as ``pretrain_*``)."""
    settings: dict[str, Any] = {}
    """What the arm ran with, outside the experiment section (``scenario.json``'s): ``section.field``
    -> value of the sections that decide its outcome (apps/experiments/resume.py, ``outcome_settings``;
    the algorithm's with the arm's overrides). What an arm added to a finished run changed is read
    here, and a resumed run compares it (empty in older files)."""
    algorithm: dict[str, Any] = {}
    """Older files only (written on 2026-12-04): the ``algorithm`` section alone, before ``settings``."""
    scenario: dict[str, Any] | None = None
    """The directory's ``scenario.json`` when the summary was written (the run writes it before any arm
    starts), without :data:`RUN_ONLY_FIELDS` (:func:`scenario_fields`): a summary marks a finished run
    of that scenario only (None in files written before 2026-12-07, and where the directory had no
    scenario). The fields themselves, not a hash of them: a field a later version of the code adds, with
    its default, is no difference (:func:`finished_summary`)."""


class ArmResults(BaseModel):
    name: str
    rewards: list[RewardRow]
    evals: list[EvalRow]
    steps: list[StepRow] = []
    summary: ArmSummary | None = None


TIMING_METRIC = re.compile(r"^time_.*_s$")
"""Step metrics that are clock readings (``PhaseTimer``): they differ between two runs of one seed."""


def decisions(results: ArmResults) -> tuple[list[tuple], list[tuple]]:
    """What a run decided, without its clock readings: every reward with its rollout, the version
    that answered and the sampled style; every learner step's rollout count, version and metrics
    (timings left out). Two runs of one seed of the in-process driver give equal decisions."""
    rewards = [(r.rollout, r.reward, r.version, r.sampled_style) for r in results.rewards]
    steps = [(s.rollout, s.version, {k: v for k, v in s.metrics.items() if not TIMING_METRIC.match(k)})
             for s in results.steps]
    return rewards, steps


def summary_path(results_dir: Path, arm: str) -> Path:
    return results_dir / f"{arm}.summary.json"


def write_summary(results_dir: Path, summary: ArmSummary) -> None:
    """Written whole or not at all (a summary marks a finished run: apps/experiments/resume.py), with
    the scenario it finished under (:func:`scenario_fields` of the directory's)."""
    path = summary_path(results_dir, summary.name)
    partial = path.with_name(path.name + ".partial")
    legacy = set() if summary.algorithm else {"algorithm"}
    scenario = scenario_fields(read_scenario(results_dir)) if (results_dir / SCENARIO_FILE).is_file() else None
    stamped = summary.model_copy(update={"scenario": scenario})
    partial.write_text(stamped.model_dump_json(indent=2, exclude=legacy) + "\n")
    partial.replace(path)


def finished_summary(results_dir: Path, arm: str) -> ArmSummary | None:
    """The summary of the finished run of ``arm`` in ``results_dir``, None when it did not finish under
    the directory's current scenario.

    A run of an arm deletes its summary before it writes anything and writes it, whole, after its
    results are complete (both drivers), so a summary marks a finished run. Files' times are not
    compared: a copied directory's are those of the copy. The summary's scenario must be the
    directory's ``scenario.json`` in every field the summary records (one it does not record, added
    by later code, is no difference): a run of another scenario, left by one
    cut short before it reached the arm, is not this scenario's. A summary without one (written before 2026-12-07) cannot
    tell, and older code left such runs under the replacing scenario: it counts as not finished, and
    a resumed run does it again. (Code before `simulate --resume` did not delete the summary first
    either, so a rerun it cut short kept the earlier run's.)"""
    summary_file, results_file = summary_path(results_dir, arm), results_dir / f"{arm}.jsonl"
    if not (summary_file.is_file() and results_file.is_file()):
        return None
    summary = ArmSummary.model_validate_json(summary_file.read_text())
    if summary.scenario is None or not (results_dir / SCENARIO_FILE).is_file():
        return None
    current = scenario_fields(read_scenario(results_dir))
    same = all(current[k] == v for k, v in summary.scenario.items() if k in current)
    return summary if same else None


def append_row(path: Path, row: RewardRow | EvalRow | StepRow) -> None:
    with path.open("a") as f:
        f.write(row.model_dump_json() + "\n")


def read_reward_rows(path: Path) -> list[RewardRow]:
    """The reward rows of ``path`` in file order (none when it does not exist yet)."""
    if not path.is_file():
        return []
    rows = (_ROW.validate_json(line) for line in path.read_text().splitlines() if line.strip())
    return [row for row in rows if isinstance(row, RewardRow)]


def count_reward_rows(path: Path) -> int:
    """Judged rollouts already in ``path`` (a restarted judge continues the count)."""
    return len(read_reward_rows(path))


def read_arm(path: Path) -> ArmResults:
    """Rows of ``<arm>.jsonl`` sorted by rollout; a rollout judged twice keeps its last row.

    Reward rows must cover rollouts 0..n-1 without gaps (the metrics index by rollout).
    """
    rewards: dict[int, RewardRow] = {}
    evals: list[EvalRow] = []
    steps: list[StepRow] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = _ROW.validate_json(line)
        if isinstance(row, RewardRow):
            rewards[row.rollout] = row
        elif isinstance(row, EvalRow):
            evals.append(row)
        else:
            steps.append(row)
    missing = sorted(set(range(len(rewards))) ^ set(rewards))
    if missing:
        raise ValueError(f"{path}: reward rows are not dense in rollout (first gap near {missing[0]})")
    name = path.name.removesuffix(".jsonl")
    summary_file = summary_path(path.parent, name)
    summary = ArmSummary.model_validate_json(summary_file.read_text()) if summary_file.is_file() else None
    return ArmResults(name=name, rewards=[rewards[i] for i in range(len(rewards))],
                      evals=sorted(evals, key=lambda e: e.rollout), steps=sorted(steps, key=lambda s: s.step),
                      summary=summary)


def write_scenario(results_dir: Path, scenario: ExperimentConfig) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / SCENARIO_FILE).write_text(scenario.model_dump_json(indent=2) + "\n")


def read_scenario(results_dir: Path) -> ExperimentConfig:
    return ExperimentConfig.model_validate(json.loads((results_dir / SCENARIO_FILE).read_text()))


def replace_scenario(results_dir: Path, scenario: ExperimentConfig) -> None:
    """Write ``scenario`` (what :func:`merged_scenario` settled) as the directory's ``scenario.json``.
    When it replaces another scenario, every arm's summary and results there go first: merged_scenario
    allowed the replacement only because this run rewrites each of them, and a run cut short before it
    reached an arm left that arm's earlier run, finished, under this scenario, where `--resume` kept it
    and the report read it as this scenario's."""
    if (results_dir / SCENARIO_FILE).is_file() and scenario_differences(read_scenario(results_dir), scenario):
        # summaries first: a run without one is unfinished, whatever else is left if this stops midway
        for summary in sorted(results_dir.glob("*.summary.json")):
            summary.unlink()
        for results in sorted(results_dir.glob("*.jsonl")):
            results.unlink()
    write_scenario(results_dir, scenario)


RUN_ONLY_FIELDS = frozenset({"arms", "jobs", "resume", "results_dir", "reference_arm"})
"""Scenario fields that may differ between runs whose arms share one results directory: which arms a
run adds, how many run side by side, whether it keeps finished runs, where the directory is, which
arm the report compares with.
Every other field changes what an arm's results mean (schedule, traffic, seeds, driver, ...)."""


def scenario_fields(scenario: ExperimentConfig) -> dict[str, Any]:
    """``scenario`` as JSON without :data:`RUN_ONLY_FIELDS`: what a summary records of the scenario it
    finished under."""
    return {k: v for k, v in scenario.model_dump(mode="json").items() if k not in RUN_ONLY_FIELDS}


class ScenarioMismatch(ConfigError):
    """A run would leave arms of another scenario in its results directory, to be reported as its own."""


def scenario_differences(old: ExperimentConfig, new: ExperimentConfig) -> list[str]:
    """The fields, outside :data:`RUN_ONLY_FIELDS`, in which ``new`` differs from ``old``."""
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    return sorted(k for k in before.keys() | after.keys()
                  if k not in RUN_ONLY_FIELDS and before.get(k) != after.get(k))


SEED_DIR = re.compile(r"^seed-(\d+)$")
"""A seed's run in a results directory of ``simulate --seeds N``: ``seed-<k>/``."""


def refuse_other_seeds(results_dir: Path, seeds: int) -> None:
    """:class:`ScenarioMismatch` when ``results_dir`` holds a one-seed run's results and this run has
    several seeds (its scenario would replace that run's and delete them), or a seed's run (a
    ``seed-<k>/`` with its scenario) that a run of ``seeds`` seeds would not write: the report reads every seed directory,
    so a seed left from an earlier run with more seeds (or any seed, under a one-seed run, whose
    results the report would then skip) would be reported as this run's."""
    if not results_dir.is_dir():
        return
    one_seed_run = sorted(p.name for pattern in ("*.jsonl", "*.summary.json") for p in results_dir.glob(pattern))
    if seeds > 1 and one_seed_run:  # its seed-<k>/ would replace the scenario, taking these files with it
        raise ScenarioMismatch(
            f"{results_dir} holds the results of an earlier one-seed run ({', '.join(one_seed_run[:4])}"
            f"{', ...' if len(one_seed_run) > 4 else ''}); a run of {seeds} seeds writes seed-<k>/ directories "
            f"and would delete them. Write this run elsewhere (experiment.results_dir), or move them away.")
    written = range(seeds) if seeds > 1 else range(0)
    others = sorted((p.name for p in results_dir.iterdir() if p.is_dir() and (match := SEED_DIR.match(p.name))
                     and (p / SCENARIO_FILE).is_file() and int(match.group(1)) not in written),
                    key=lambda name: int(name.removeprefix("seed-")))
    if others:
        raise ScenarioMismatch(
            f"{results_dir} holds the run(s) of {', '.join(others)} from an earlier run with more seeds; a run "
            f"of {seeds} seed(s) would not write them and its report would read them as its own. Write this "
            f"run elsewhere (experiment.results_dir), or move that directory away.")


def merged_scenario(results_dir: Path, scenario: ExperimentConfig, running: list[str]) -> ExperimentConfig:
    """What ``results_dir``'s ``scenario.json`` says after a run of the arms ``running`` with ``scenario``.

    A directory that already holds a run of the same scenario (up to :data:`RUN_ONLY_FIELDS`) keeps
    the arms this run does not rewrite, and the file lists the earlier run's arms and then this run's
    (this run's definition wins for a name in both), so one report compares them: an arm added later
    runs on the same seeds and traffic as the others. With another scenario, arms left from the
    earlier run would be read under this run's schedule and traffic: :class:`ScenarioMismatch`, unless
    this run rewrites every arm the directory holds, and then this run's scenario replaces the earlier.
    """
    if not (results_dir / SCENARIO_FILE).is_file():
        return scenario
    earlier = read_scenario(results_dir)
    differences = scenario_differences(earlier, scenario)
    if not differences:
        mine = {a.name for a in scenario.arms}
        return scenario.model_copy(update={"arms": [a for a in earlier.arms if a.name not in mine] + scenario.arms})
    kept = sorted(name for name in (p.name.removesuffix(".jsonl") for p in results_dir.glob("*.jsonl"))
                  if name not in running)
    if kept:
        raise ScenarioMismatch(
            f"{results_dir} holds results of arm(s) {kept} from a scenario that differs in "
            f"{', '.join(differences)}; this run would report them as its own. Run those arms again too, "
            f"write this run elsewhere (experiment.results_dir), or move that directory away.")
    return scenario
