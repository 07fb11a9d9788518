"""Files of one experiment run, written by the judge and the evaluation, read by the report.

Layout of a results directory:

* ``scenario.json`` -- the ExperimentConfig the run used (schedule, window, seeds).
* ``<arm>.jsonl`` -- one JSON object per line: a :class:`RewardRow` for every judged
  rollout and an :class:`EvalRow` for every held-out style measurement.
* ``<arm>.summary.json`` (optional) -- an :class:`ArmSummary` the orchestration writes
  when an arm ends (e.g. grpo's time spent waiting for groups, from the learner).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from apps.config import ExperimentConfig

SCENARIO_FILE = "scenario.json"


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RewardRow(_Row):
    """One judged rollout (the score is recorded whether or not the reward was delivered)."""

    kind: Literal["reward"] = "reward"
    rollout: int = Field(ge=0)
    """0-based count of judged rollouts of the arm (the schedule's clock)."""
    t: float
    """Unix time of judging."""
    version: int = Field(ge=0)
    """Newest policy version that sampled the answer."""
    reward: float
    quality: float
    style: float
    preferred: str
    delivered: bool = True
    """False when the judge dropped the reward (experiment.drop_rate)."""
    interaction_id: str | None = None


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


ResultRow = Annotated[Union[RewardRow, EvalRow], Field(discriminator="kind")]
_ROW = TypeAdapter(ResultRow)


class ArmSummary(_Row):
    name: str
    algorithm: dict = {}
    group_wait_s: float | None = None
    """Seconds the learner spent waiting for groups to complete (grpo only)."""
    wall_s: float | None = None


class ArmResults(BaseModel):
    name: str
    rewards: list[RewardRow]
    evals: list[EvalRow]
    summary: ArmSummary | None = None


def append_row(path: Path, row: RewardRow | EvalRow) -> None:
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
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = _ROW.validate_json(line)
        if isinstance(row, RewardRow):
            rewards[row.rollout] = row
        else:
            evals.append(row)
    missing = sorted(set(range(len(rewards))) ^ set(rewards))
    if missing:
        raise ValueError(f"{path}: reward rows are not dense in rollout (first gap near {missing[0]})")
    name = path.name.removesuffix(".jsonl")
    summary_path = path.with_name(f"{name}.summary.json")
    summary = ArmSummary.model_validate_json(summary_path.read_text()) if summary_path.is_file() else None
    return ArmResults(name=name, rewards=[rewards[i] for i in range(len(rewards))],
                      evals=sorted(evals, key=lambda e: e.rollout), summary=summary)


def write_scenario(results_dir: Path, scenario: ExperimentConfig) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / SCENARIO_FILE).write_text(scenario.model_dump_json(indent=2) + "\n")


def read_scenario(results_dir: Path) -> ExperimentConfig:
    return ExperimentConfig.model_validate(json.loads((results_dir / SCENARIO_FILE).read_text()))
