"""When the champion cannot be scored on current traffic: the candidate against the champion's record.

Without a canary, every answer in the gate's window was sampled by the versions after the
candidate. A champion many versions behind rarely samples those answers, so its importance
weights collapse onto one or two of them and its effective sample size falls under
``deploy.gate_min_ess``: the gate refuses, the champion never changes, and it falls further
behind with every version, so the gate refuses for the rest of the phase (docs/DEPLOY.md,
"Measured on the drift scenario").

A **record** is a version's expected reward as last measured on traffic it could be scored on:
its candidate-side estimate at the decision that promoted it, refreshed whenever a later
decision scores the champion with an ESS at the floor on a window that covers it
(:func:`window_judges`). It lives on the champion's registry
version as ``record.*`` tags. A drift restart becomes champion without one, so a record never
crosses a detected preference change; at a decision where the restart cannot be scored and
has none, its record is measured on the window's rollouts sampled since it (the new
preference's traffic, on which it was not trained; trainer/releases.py).

When the window cannot judge the champion (its ESS under the floor, or an undecided interval
on a window holding less than half of the champion: :func:`champion_unscorable`) and it has a
record, the candidate is compared with the record instead: ``D = V_cand - V_record``, two estimates on disjoint rollouts, so
``se^2 = se_cand^2 + se_record^2``, and the same non-inferiority rule
(:func:`online_sao.gate.verdict`) **except that it never rolls back**: a record was measured
under the rewards of its time, and a candidate falling short of it is exactly what a
preference change looks like before the detector has seen it. Rolling back on a record would
return to the old preference's policy, the failure the gate must not have. A candidate that
is worse by the current rewards is left undecided (serving keeps the champion as its
roll-back target) and the monitors, which need no champion, can still roll it back. The
candidate's side is widened by the mass of it the window does not cover, as on a same-window
decision (online_sao/gate.py, "What the window does not cover"), and the record's side by the mass
its own window did not cover (kept with it: a record taken where the window held a tenth of the
champion's mass is its value on that tenth; before, it was decided on as the champion's value).
A record holds only under the rewards it was measured with. A drift restart starts without one,
but an operator can change what a reward means without a restart: another source trained on,
another aggregation, a new judge prompt. A record measured under the old rewards would then be a
stale bar, and a candidate compared with a record on a lower scale would be promoted however it
does now. So each record carries the reward definition it was measured under
(``RewardConfig.definition``: a digest of the reward settings and ``reward.revision``), and one
measured under another (:func:`comparable`) is not decided on: the learner treats the champion as
having no record and measures a new one where it can. A record written before definitions were kept
has none and is taken as measured under the current one.
The record is read from one tag, ``record`` (all its fields, written in one registry call, so a
refresh cut short leaves the old record or the new one, never a mix); the ``record.*`` tags beside
it are the same fields for people reading the registry, written before it. A registry written by
older code has only the ``record.*`` tags: they are read when ``record`` is absent, and an
incomplete or unreadable record is read as none.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist

import torch

from online_sao.gate import (GateEvidence, GateSettings, coverage, not_on_a_broken_range, range_problem, snis_estimate,
                             value_bounds, verdict)

log = logging.getLogger(__name__)

RECORD_TAG = "record"
"""The registry tag the record is read from: every field in one JSON object, so that one registry
call writes it whole."""
RECORD_TAGS = ("record.value", "record.se", "record.n", "record.ess", "record.window_versions")
"""The record's fields one tag each, for people reading the registry (and the only record older code
wrote). Written one registry call each, so a learner stopped between two calls leaves some of them
new and some old: they are read only when ``record`` is absent."""
DEFINITION_TAG = "record.reward_definition"
"""The readable tag of the record's reward definition (not in :data:`RECORD_TAGS`: records written
before definitions were kept lack it and are still complete)."""
MIN_JUDGED_COVERAGE = 0.5
"""The least share of the champion's mass a window must hold to judge it (and refresh its record):
under it the window has seen less of the champion than it has not, and its value's interval is
mostly the reward range. Not a test of ``(1 - c)(r_max - r_min)`` against the margin: a champion
with full support has a ``c`` that falls under 1 by chance (a sample mean of heavy-tailed
ratios), under 0.95 in about half of the gate_coverage benchmark's mildly-off windows
(benchmarks/gate_coverage.py's cases, 600 windows of 40 each), which then went to a record that
may be stale; under 0.5 in 1 of 600. The stuck gate this guards against had ``c`` about 0.001."""
COVERAGE_TAG = "record.coverage"
"""The readable tag of the record's coverage (not in :data:`RECORD_TAGS`, like :data:`DEFINITION_TAG`)."""


@dataclass(frozen=True)
class ValueRecord:
    """A version's expected reward measured on one window of rollouts."""

    value: float
    se: float
    """Standard error of ``value`` (:func:`online_sao.gate.snis_standard_error`)."""
    n: int
    ess: float
    window: tuple[int, int]
    """Lowest and highest policy version that sampled the rollouts it was measured on."""
    reward_definition: str = ""
    """The rewards it was measured under (``RewardConfig.definition``); empty: not known (a record
    written before definitions were kept)."""
    coverage: float = 1.0
    """The share of the version's mass the window it was measured on held (:func:`online_sao.gate.coverage`):
    ``value`` is its value on that share only, and a decision on the record widens it by the rest
    as a same-window decision does. 1: a record written before coverage was kept."""

    def tags(self) -> dict[str, str]:
        """The registry tags, in the order to write them: the readable ones first, ``record`` last."""
        whole = json.dumps({"value": self.value, "se": self.se, "n": self.n, "ess": self.ess,
                            "window": list(self.window), "reward_definition": self.reward_definition,
                            "coverage": self.coverage})
        return {"record.value": repr(self.value), "record.se": repr(self.se), "record.n": str(self.n),
                "record.ess": repr(self.ess), "record.window_versions": f"{self.window[0]}-{self.window[1]}",
                DEFINITION_TAG: self.reward_definition, COVERAGE_TAG: repr(self.coverage), RECORD_TAG: whole}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> ValueRecord | None:
        """The record in a registry version's tags; None if it has none, and None with a warning
        naming what is wrong if it is unreadable, or (older registries' ``record.*`` tags)
        incomplete: the champion is then decided as one without a record, never crashes the learner."""
        if RECORD_TAG in tags:
            try:
                fields = json.loads(tags[RECORD_TAG])
                low, high = fields["window"]
                return cls(float(fields["value"]), float(fields["se"]), int(fields["n"]), float(fields["ess"]),
                           (int(low), int(high)), str(fields.get("reward_definition", "")),
                           float(fields.get("coverage", 1.0)))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("champion's record is unreadable (%r; tag %s=%r): treated as no record", exc,
                            RECORD_TAG, tags[RECORD_TAG])
                return None
        present = [key for key in RECORD_TAGS if key in tags]
        if not present:
            return None
        missing = [key for key in RECORD_TAGS if key not in tags]
        if missing:
            log.warning("champion's record is incomplete (missing %s; present %s): treated as no record",
                        ", ".join(missing), ", ".join(present))
            return None
        try:
            low, high = tags["record.window_versions"].split("-")
            return cls(float(tags["record.value"]), float(tags["record.se"]), int(tags["record.n"]),
                       float(tags["record.ess"]), (int(low), int(high)), tags.get(DEFINITION_TAG, ""),
                       float(tags.get(COVERAGE_TAG, 1.0)))
        except ValueError as exc:
            log.warning("champion's record is unreadable (%s; tags %s): treated as no record", exc,
                        {key: tags[key] for key in RECORD_TAGS})
            return None


def comparable(record: ValueRecord, settings: GateSettings) -> bool:
    """Whether ``record`` was measured under the rewards the gate decides on now (module docstring):
    the same reward definition, or one of the two not known."""
    return not record.reward_definition or not settings.reward_definition \
        or record.reward_definition == settings.reward_definition


def _meets_floors(n: int, ess: float, settings: GateSettings, covered: float = 1.0) -> bool:
    """Measured well enough to decide on: ``n`` and the ESS at the gate's floors, the coverage known
    (NaN fails)."""
    return n >= settings.min_rollouts and ess >= settings.min_ess and covered >= 0


def measure(rewards: torch.Tensor, log_ratio: torch.Tensor, settings: GateSettings,
            window: tuple[int, int]) -> ValueRecord | None:
    """A version's record measured on rollouts it was not trained on (``[B]`` rewards and its
    sequence log-ratios), None when under the gate's floors."""
    n = int(rewards.shape[0])
    if n < settings.min_rollouts:
        return None
    value, metrics = snis_estimate(rewards, log_ratio, settings.weight_clip)
    covered = coverage(log_ratio)
    if not _meets_floors(n, metrics["ess"], settings, covered):
        return None
    return ValueRecord(value, metrics["se"], n, metrics["ess"], window, settings.reward_definition, covered)


def candidate_record(evidence: GateEvidence, settings: GateSettings) -> ValueRecord | None:
    """The candidate's side of a decision as a record, if it was measured well enough to decide on
    (``n`` and its ESS at the floors)."""
    if not _meets_floors(evidence.n, evidence.candidate_ess, settings, evidence.candidate_coverage):
        return None
    return ValueRecord(evidence.candidate_value, evidence.candidate_se, evidence.n, evidence.candidate_ess,
                       evidence.window, settings.reward_definition, evidence.candidate_coverage)


def champion_record(evidence: GateEvidence, settings: GateSettings) -> ValueRecord | None:
    """The champion's side of a same-window decision as its refreshed record, if measured well
    enough to decide on; None for a decision on a record (nothing new was measured)."""
    if evidence.basis != "window" or not _meets_floors(evidence.n, evidence.champion_ess, settings,
                                                       evidence.champion_coverage) \
            or not window_judges(evidence.champion_coverage, settings):
        return None
    return ValueRecord(evidence.champion_value, evidence.champion_se, evidence.n, evidence.champion_ess,
                       evidence.window, settings.reward_definition, evidence.champion_coverage)


def window_judges(covered: float, settings: GateSettings) -> bool:
    """Whether a window holding the share ``covered`` of a version's mass can judge the version: at
    least :data:`MIN_JUDGED_COVERAGE` of it (online_sao/gate.py, "What the window does not cover").
    Always without a reward range (the coverage is not used then); never for a NaN coverage."""
    if settings.reward_min is None:
        return True
    return covered >= MIN_JUDGED_COVERAGE


def champion_unscorable(evidence: GateEvidence, settings: GateSettings) -> bool:
    """The window cannot judge the champion, and only the champion stands in the way: enough
    rollouts and the candidate's ESS at the floor, and either the gate refused for the champion's
    ESS (under the floor or NaN: log-ratios of ``-inf`` everywhere) or it is undecided with the
    champion covered too little to be judged (:func:`window_judges`): an ESS at the floor from
    weights that are small but even says nothing of the mass the window does not hold."""
    if evidence.n < settings.min_rollouts or not evidence.candidate_ess >= settings.min_ess:
        return False
    if evidence.decision == "refused":
        return not evidence.champion_ess >= settings.min_ess
    return evidence.decision == "undecided" and not window_judges(evidence.champion_coverage, settings)


def decide_against_record(rewards: torch.Tensor, log_ratio_candidate: torch.Tensor, record: ValueRecord,
                          settings: GateSettings, window: tuple[int, int] = (0, 0)) -> GateEvidence:
    """The candidate's estimate on the window (``[B]`` rewards and sequence log-ratios) against the
    champion's ``record`` (module docstring); never ``rolled_back``. A ``record`` measured under other
    rewards (:func:`comparable`) is an error: the caller treats it as none."""
    if not comparable(record, settings):
        raise ValueError(f"the record was measured under reward definition {record.reward_definition}, "
                         f"the gate decides under {settings.reward_definition}")
    n = int(rewards.shape[0])
    if n == 0:
        nan = math.nan
        return GateEvidence("refused", f"empty window (need {settings.min_rollouts})", 0, nan, record.value, nan,
                            nan, nan, 0.0, record.ess, window, champion_se=record.se, basis="record",
                            record_window=record.window)
    value, metrics = snis_estimate(rewards, log_ratio_candidate, settings.weight_clip)
    se_candidate = metrics["se"]
    diff = value - record.value
    half = NormalDist().inv_cdf((1 + settings.confidence) / 2) * math.hypot(se_candidate, record.se)
    covered = coverage(log_ratio_candidate)  # each side's unseen mass widens it (online_sao/gate.py)
    low, high = value_bounds(value, covered, settings)
    record_low, record_high = value_bounds(record.value, record.coverage, settings)
    low_d, high_d = low - record_high - half, high - record_low + half
    decision, reason = verdict(n, metrics["ess"], low_d, high_d, settings, may_roll_back=False)
    decision, reason = not_on_a_broken_range(decision, reason, range_problem(rewards, settings),
                                             (covered, record.coverage))
    return GateEvidence(decision, f"{reason} (champion's record)", n, value, record.value, diff, low_d, high_d,
                        metrics["ess"], record.ess, window, candidate_se=se_candidate, champion_se=record.se,
                        basis="record", record_window=record.window, candidate_coverage=covered,
                        champion_coverage=record.coverage)
