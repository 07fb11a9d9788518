"""Resuming a sweep (``simulate --resume``): which (seed, arm) runs of a results directory finished,
and whether they ran with the settings this run would use.

A multi-seed sweep runs for hours (six arms of drift.yaml on twenty seeds, in process, about an hour
on two cores; live, about half a day); a crash, a reboot or an interrupt should cost the run under way, not the
runs already done. A run counts as finished when its summary says so and was written under the
directory's current scenario (results.finished_summary: a run of a scenario since replaced is not
this one's, and a summary from before summaries recorded their scenario is run again).

What a finished run is compared on: ``scenario.json`` for the experiment section (the run refuses, as
any run into the directory does, when the scenario differs: results/merged_scenario) and the
summary's ``settings`` for the rest of the arm's configuration (:func:`outcome_settings`). A finished
run with other settings is refused rather than redone or kept: either would leave a report whose
arms ran under two configurations without saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from apps.config import AppConfig
from apps.experiments.results import finished_summary
from online_sao.config import ConfigError, flat_settings

OUTCOME_SECTIONS = ("model", "algorithm", "reward", "serving", "trainer", "deploy", "drift")
"""The sections of an arm's configuration that decide what it does (the experiment section is
``scenario.json``'s). ``paths``, ``kafka`` and ``mlflow`` say where things are, not what happens."""

PER_RUN_FIELDS = frozenset({"serving.port", "trainer.pretrain_file", "serving.spool_dir", "trainer.weight_store",
                            "trainer.checkpoint_dir"})
"""Fields a driver sets afresh for every run of an arm without changing what it does: the live
driver's free port for serving, the path of the seed's value pre-training data (whether there
is any is ``experiment.pretrain_rollouts`` and the arm's algorithm), and the arm's state
directories, which are under the results directory (scenario.arm_config): a results directory
moved or copied elsewhere resumes there."""

MAX_LISTED = 8
"""Differing settings named in a refusal; the rest are counted."""


class ResumeMismatch(ConfigError):
    """A finished run of the results directory ran with other settings than this run would use."""


def outcome_settings(acfg: AppConfig) -> dict[str, Any]:
    """``section.field`` -> value (JSON types, secrets masked) of the :data:`OUTCOME_SECTIONS` of an
    arm's configuration, without the :data:`PER_RUN_FIELDS`: what a resumed run compares."""
    dump = acfg.model_dump(mode="json")
    flat = flat_settings({section: dump[section] for section in OUTCOME_SECTIONS})
    return {key: value for key, value in flat.items() if key not in PER_RUN_FIELDS}


@cache
def default_settings() -> dict[str, Any]:
    """:func:`outcome_settings` of the default configuration."""
    return outcome_settings(AppConfig())


def setting_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: recorded -> current`` for every key whose value differs or that only one side has, unless that
    side has it at its default: a summary written before a setting existed does not record it, and code
    that has it records its default (a run of ``serving.device`` "auto" is the run of before). An entry of
    a mapping setting has no default (an empty mapping records no key), so one side's entry counts."""
    missing = object()
    defaults = default_settings()
    lines = []
    for key in sorted(recorded.keys() | current.keys()):
        before, after = recorded.get(key, missing), current.get(key, missing)
        one_sided = after if before is missing else before if after is missing else missing
        if before != after and not (one_sided is not missing and defaults.get(key, missing) == one_sided):
            show = [("(absent)" if v is missing else json.dumps(v)) for v in (before, after)]
            lines.append(f"{key}: {show[0]} -> {show[1]}")
    return lines


def finished_arms(directory: Path, arms: Iterable[str], settings_of: Callable[[str], dict[str, Any]]) -> list[str]:
    """The arms of ``arms`` whose run in ``directory`` finished with the settings this run would use
    (``settings_of(arm)``, :func:`outcome_settings`). A finished run without recorded settings or
    scenario (an older file), or of another scenario than the directory's (results.finished_summary),
    counts as not finished, so it runs again; one with other settings raises :class:`ResumeMismatch`."""
    done = []
    for arm in arms:
        summary = finished_summary(directory, arm)
        if summary is None or not summary.settings:
            continue
        # summaries written before a field was per-run still record it
        recorded = {key: value for key, value in summary.settings.items() if key not in PER_RUN_FIELDS}
        differences = setting_differences(recorded, settings_of(arm))
        if differences:
            listed = "; ".join(differences[:MAX_LISTED])
            more = f" (and {len(differences) - MAX_LISTED} more)" if len(differences) > MAX_LISTED else ""
            raise ResumeMismatch(
                f"{directory}: arm {arm!r} finished with other settings than this run's: {listed}{more}. "
                "Resuming would report runs of two configurations as one arm: run without --resume to "
                "run every arm again, or write this run elsewhere (experiment.results_dir).")
        done.append(arm)
    return done
