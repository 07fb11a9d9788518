"""``online-sao lr-sweep``: the same small policy learning-rate sweep for every arm.

Each arm of the scenario (or the named ones) runs once per rate in ``--rates``, as arm
``<arm>_lr<rate>`` with only ``algorithm.policy_lr`` changed (the critic's rate stays as
configured), on the same seeds and traffic, with the scenario's driver. Rates whose names
(``{rate:g}``, six significant digits) are equal are refused: they would name one arm twice.
The results go to ``<results>/lr-sweep`` with their own report; the command prints, per arm, the rate
with the highest mean reward over seeds. Choosing on the mean over all phases, not on
one phase, keeps the choice from favouring an arm's first style.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from apps.config import AppConfig, ArmConfig, ExperimentConfig
from apps.experiments.aggregate import ArmSummaryAcrossSeeds
from online_sao.config import ConfigError

SWEEP_DIR = "lr-sweep"
SEPARATOR = "_lr"
"""Arm names allow letters, digits, ``_``, ``.`` and ``-`` only: ``sao_lr0.0003``."""


def rate_label(rate: float) -> str:
    """How a rate appears in its arm's name (six significant digits)."""
    return f"{rate:g}"


def sweep_arm_name(arm: str, rate: float) -> str:
    return f"{arm}{SEPARATOR}{rate_label(rate)}"


def clashing_rates(rates: list[float]) -> dict[str, list[float]]:
    """The rates that share a name (:func:`rate_label`), by that name."""
    by_label: dict[str, list[float]] = {}
    for rate in rates:
        by_label.setdefault(rate_label(rate), []).append(rate)
    return {label: same for label, same in by_label.items() if len(same) > 1}


def parse_sweep_arm(name: str) -> tuple[str, float]:
    """(arm, rate) of a sweep arm's name."""
    arm, sep, rate = name.rpartition(SEPARATOR)
    if not sep:
        raise ValueError(f"{name!r} is not a sweep arm (<arm>{SEPARATOR}<rate>)")
    return arm, float(rate)


def sweep_config(cfg: AppConfig, rates: list[float], arms: list[str] | None = None) -> AppConfig:
    """``cfg`` whose arms are every (chosen arm, rate) pair and whose results go to ``<results>/lr-sweep``."""
    from apps.experiments.scenario import results_dir

    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ConfigError(f"rates must be positive and finite, got {rates}")
    clashes = clashing_rates(rates)
    if clashes:  # each would name an arm twice: one run, and a scenario.json the report cannot read
        raise ConfigError("rates must differ in their first six significant digits (an arm is named "
                          f"<arm>{SEPARATOR}<rate>); these share a name: "
                          + "; ".join(f"{same} as {label}" for label, same in clashes.items()))
    chosen = [a for a in cfg.experiment.arms if arms is None or a.name in arms]
    unknown = set(arms or []) - {a.name for a in chosen}
    if unknown:
        raise ConfigError(f"unknown arm(s) {sorted(unknown)}")
    variants = [ArmConfig(name=sweep_arm_name(a.name, rate), algorithm={**a.algorithm, "policy_lr": rate})
                for a in chosen for rate in rates]
    try:  # validated, unlike a model_copy: the scenario's own checks hold for the sweep's arms
        exp = ExperimentConfig.model_validate({**dict(cfg.experiment), "arms": variants,
                                               "results_dir": results_dir(cfg) / SWEEP_DIR, "reference_arm": None})
    except ValidationError as exc:
        raise ConfigError(f"the sweep's scenario is not valid: {exc}") from None
    return cfg.model_copy(update={"experiment": exp})


def best_rates(arms: list[ArmSummaryAcrossSeeds]) -> dict[str, tuple[float, float]]:
    """Per arm: (rate, mean reward over seeds) of the rate with the highest mean reward."""
    best: dict[str, tuple[float, float]] = {}
    for summary in arms:
        if summary.mean_reward is None:
            continue
        arm, rate = parse_sweep_arm(summary.name)
        if arm not in best or summary.mean_reward.mean > best[arm][1]:
            best[arm] = (rate, summary.mean_reward.mean)
    return best


def run_lr_sweep(cfg: AppConfig, rates: list[float], arms: list[str] | None = None,
                 progress: Callable[[str], None] = print) -> Path:
    """Run the sweep and its report; returns the report's path."""
    from apps.experiments.aggregate import load_runs, summarize
    from apps.experiments.orchestrate import run_simulation

    swept = sweep_config(cfg, rates, arms)
    report = run_simulation(swept, progress=progress)
    for arm, (rate, reward) in best_rates(summarize(load_runs(report.parent.parent))).items():
        progress(f"{arm}: best policy_lr {rate:g} (mean reward {reward:.3f})")
    return report
