"""What the gate's window does not cover (online_sao/gate.py, "What the window does not cover") and
NaN evidence, against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from online_sao.gate import GateSettings, coverage, decide, value_bounds, verdict
from online_sao.gate_record import (ValueRecord, champion_record, champion_unscorable, decide_against_record,
                                    window_judges)

UNBOUNDED = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05)
BOUNDED = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05, reward_min=0.0, reward_max=1.0)
"""The same floors and test, with rewards known to lie in [0, 1]."""
Z90 = 1.6448536269514722
"""Two-sided 90% normal quantile."""


def test_coverage_by_hand():
    assert coverage(torch.log(torch.tensor([0.5, 0.1, 0.3]))) == pytest.approx(0.3)  # (0.5 + 0.1 + 0.3) / 3
    assert coverage(torch.log(torch.tensor([2.0, 0.5]))) == 1.0  # mean 1.25: capped at 1
    assert coverage(torch.tensor([1000.0, 1000.0])) == 1.0  # e^1000 would overflow outside log space
    assert coverage(torch.tensor([-1000.0, math.log(0.4) - 1000.0])) == pytest.approx(0.7 * math.exp(-1000))
    assert coverage(torch.full((3,), -math.inf)) == 0.0
    assert math.isnan(coverage(torch.tensor([0.0, math.nan])))


def test_value_bounds_by_hand():
    assert value_bounds(0.5, 0.1, BOUNDED) == (pytest.approx(0.05), pytest.approx(0.95))  # 0.05 + 0.9 * [0, 1]
    assert value_bounds(0.5, 1.0, BOUNDED) == (0.5, 0.5)
    assert value_bounds(0.5, 0.1, UNBOUNDED) == (0.5, 0.5)  # no range given: not widened


def test_a_champion_the_window_hardly_covers_is_not_beaten_on_the_tenth_it_saw():
    """The candidate is the behaviour; the champion's ratio is 0.1 on every rollout (90% of its mass is
    where the window has nothing). Equal weights: V_cand = V_champ = 1/2, se 0, ESS 4 each. The old
    interval [0, 0] promoted; bounded, the champion's value is in [0.05, 0.95]."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    champion = torch.full((4,), math.log(0.1))
    assert decide(rewards, torch.zeros(4), champion, UNBOUNDED).decision == "promoted"
    evidence = decide(rewards, torch.zeros(4), champion, BOUNDED)
    assert (evidence.low, evidence.high) == (pytest.approx(0.5 - 0.95), pytest.approx(0.5 - 0.05))
    assert evidence.decision == "undecided" and "coverage: candidate 1.000, champion 0.100" in evidence.reason
    assert evidence.difference == 0.0 and evidence.champion_ess == pytest.approx(4.0)
    tags = evidence.tags()
    assert float(tags["gate.candidate_coverage"]) == 1.0
    assert float(tags["gate.champion_coverage"]) == pytest.approx(0.1)
    # its ESS is at the floor, but the window holds a tenth of it (under MIN_JUDGED_COVERAGE): it
    # cannot judge it, so its record is asked for, and this window is no record to keep
    assert not window_judges(0.1, BOUNDED) and champion_unscorable(evidence, BOUNDED)
    assert champion_record(evidence, BOUNDED) is None


def test_the_window_judges_a_version_it_holds_at_least_half_of():
    """MIN_JUDGED_COVERAGE 0.5: a window holding less of the champion than it does not hold cannot
    judge it. Not (1 - c)(r_max - r_min) <= margin: c of a champion with full support falls under
    0.95 by chance, and such windows went to a record that may be stale (test below)."""
    assert window_judges(1.0, BOUNDED) and window_judges(0.5, BOUNDED) and not window_judges(0.49, BOUNDED)
    assert not window_judges(math.nan, BOUNDED)
    assert window_judges(0.1, UNBOUNDED)  # no range: the coverage is not used
    # undecided on a champion the window covers: the window's verdict stands, no record asked for
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    covered = decide(rewards, torch.zeros(4), torch.log(torch.tensor([1.2, 0.8, 0.8, 1.2])), BOUNDED)
    assert covered.decision == "undecided" and covered.champion_coverage == 1.0
    assert not champion_unscorable(covered, BOUNDED)


def test_a_champion_the_window_mostly_covers_is_judged_by_it_and_its_record_refreshed():
    """Champion ratio 0.8 on every rollout (coverage 0.8, V 1/2 as the candidate's, se 0): its value
    lies in [0.4, 0.6] and the interval [-0.1, 0.1] is undecided on the window itself. With the
    margin as the bar (0.2 of the range unseen > 0.05) it went to the champion's record instead, and
    this window refreshed nothing."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    evidence = decide(rewards, torch.zeros(4), torch.full((4,), math.log(0.8)), BOUNDED)
    assert evidence.decision == "undecided" and evidence.champion_coverage == pytest.approx(0.8)
    assert (evidence.low, evidence.high) == (pytest.approx(-0.1), pytest.approx(0.1))
    assert not champion_unscorable(evidence, BOUNDED)
    record = champion_record(evidence, BOUNDED)
    assert record is not None and record.coverage == pytest.approx(0.8) and record.value == pytest.approx(0.5)


def test_a_candidate_the_window_half_covers_cannot_be_promoted_on_its_half():
    """Every reward 1, candidate ratio 0.5 everywhere, champion the behaviour: V both 1, se 0.
    The candidate's value lies in [0.5, 1]: interval [-0.5, 0]."""
    evidence = decide(torch.ones(4), torch.full((4,), math.log(0.5)), torch.zeros(4), BOUNDED)
    assert (evidence.low, evidence.high) == (pytest.approx(-0.5), pytest.approx(0.0))
    assert evidence.decision == "undecided" and evidence.candidate_coverage == pytest.approx(0.5)


def test_well_covered_versions_keep_the_interval_exactly():
    """Candidate ratios 2, 1, 2, 1 (mean 1.5: coverage 1), champion the behaviour: the hand case of
    test_gate.py, interval 1/6 +- z/36, whether or not the rewards' range is known."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    candidate = torch.log(torch.tensor([2.0, 1.0, 2.0, 1.0]))
    plain, bounded = decide(rewards, candidate, torch.zeros(4), UNBOUNDED), decide(rewards, candidate,
                                                                                   torch.zeros(4), BOUNDED)
    assert (bounded.low, bounded.high) == (plain.low, plain.high)
    assert bounded.low == pytest.approx(1 / 6 - Z90 / 36) and bounded.reason == plain.reason
    assert (bounded.candidate_coverage, bounded.champion_coverage) == (1.0, 1.0)


def test_against_a_record_the_candidates_unseen_mass_widens_its_side():
    """40 rewards of 1 at candidate ratio 0.5 (V 1, se 0, coverage 0.5) against a record of 0.5 with
    se 0.05: unbounded [0.5 - h, 0.5 + h] promoted; bounded the candidate is in [0.5, 1]:
    [-h, 0.5 + h] with h = z * 0.05, about 0.082, undecided."""
    record = ValueRecord(0.5, 0.05, 40, 30.0, (1, 2))
    half = Z90 * 0.05
    log_ratio = torch.full((40,), math.log(0.5))
    assert decide_against_record(torch.ones(40), log_ratio, record, UNBOUNDED).decision == "promoted"
    evidence = decide_against_record(torch.ones(40), log_ratio, record, BOUNDED)
    assert (evidence.low, evidence.high) == (pytest.approx(-half), pytest.approx(0.5 + half))
    assert evidence.decision == "undecided" and evidence.candidate_coverage == pytest.approx(0.5)


def test_a_champion_outside_every_nucleus_is_refused_and_its_record_consulted():
    """Every rollout holds a token outside the champion's top-p nucleus: its log-ratios are -inf,
    its weights 0/0. That is a champion the window cannot score, not an undecided comparison."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    evidence = decide(rewards, torch.zeros(5), torch.full((5,), -math.inf), BOUNDED)
    assert evidence.decision == "refused" and evidence.reason == "ess=nan < min_ess=2.0"
    assert math.isnan(evidence.champion_ess) and evidence.candidate_ess == pytest.approx(5.0)
    assert champion_unscorable(evidence, BOUNDED)  # so the gate asks for the champion's record
    on_record = decide_against_record(rewards, torch.zeros(5), ValueRecord(0.2, 0.05, 40, 30.0, (1, 2)), BOUNDED)
    assert on_record.decision == "promoted" and on_record.difference == pytest.approx(0.4)  # 3/5 - 0.2
    stale_candidate = decide(rewards, torch.full((5,), -math.inf), torch.zeros(5), BOUNDED)
    assert stale_candidate.decision == "refused" and not champion_unscorable(stale_candidate, BOUNDED)


def test_verdict_refuses_nan():
    assert verdict(4, math.nan, 0.0, 0.1, UNBOUNDED) == ("refused", "ess=nan < min_ess=2.0")
    assert verdict(4, 4.0, math.nan, math.nan, UNBOUNDED)[0] == "refused"


def test_a_reward_range_is_given_whole_and_in_order():
    with pytest.raises(ValueError, match="together"):
        GateSettings(4, 2.0, 0.9, 0.05, reward_min=0.0)
    with pytest.raises(ValueError, match="below"):
        GateSettings(4, 2.0, 0.9, 0.05, reward_min=1.0, reward_max=1.0)


def test_a_record_keeps_its_coverage_and_a_decision_on_it_widens_the_records_side():
    """The champion's record is refreshed on a window that held 0.96 of its mass: 100 rollouts, rewards alternating 1, 0, champion ratio 0.96 each (V 0.5).
    Its value lies in [0.48, 0.52]. A later candidate at 0.6 (60 of 100, ratios 1, se
    sqrt(0.24 / 100)) decided on that record: [0.6 - 0.52 - h, 0.6 - 0.48 + h]. On a window that held
    a tenth of it the champion is not judged and its old record is kept: that tenth is no record."""
    rewards = torch.tensor([float(i % 2) for i in range(100)])
    refreshed = decide(rewards, torch.zeros(100), torch.full((100,), math.log(0.96)), BOUNDED, (5, 6))
    record = champion_record(refreshed, BOUNDED)
    assert record is not None and record.coverage == pytest.approx(0.96) and record.value == pytest.approx(0.5)
    assert ValueRecord.from_tags(record.tags()) == record  # it round-trips through the registry
    se_record = 0.5 / 10  # equal weights, V 0.5: sqrt(100 * 0.25) / 100
    assert record.se == pytest.approx(se_record)
    later = torch.tensor([1.0] * 60 + [0.0] * 40)
    evidence = decide_against_record(later, torch.zeros(100), record, BOUNDED, (7, 8))
    half = Z90 * math.hypot(math.sqrt(0.24 / 100), se_record)
    assert (evidence.low, evidence.high) == (pytest.approx(0.6 - 0.52 - half), pytest.approx(0.6 - 0.48 + half))
    assert evidence.champion_coverage == pytest.approx(0.96)
    tenth = decide(rewards, torch.zeros(100), torch.full((100,), math.log(0.1)), BOUNDED, (5, 6))
    assert tenth.decision == "undecided" and champion_record(tenth, BOUNDED) is None


def test_a_window_whose_totals_break_the_range_decides_nothing_on_the_coverage_bound():
    """Rewards 2, 0, 2, 0 (two rewards of 1 summed) against the range [0, 1]; candidate the behaviour,
    champion ratio 0.9 everywhere: V both 1, se 0, champion coverage 0.9, its value "in" [0.9, 1.0]:
    interval [0, 0.1], promoted before, though the unseen tenth may earn 2."""
    rewards = torch.tensor([2.0, 0.0, 2.0, 0.0])
    evidence = decide(rewards, torch.zeros(4), torch.full((4,), math.log(0.9)), BOUNDED)
    assert (evidence.low, evidence.high) == (pytest.approx(0.0), pytest.approx(0.1))
    assert evidence.decision == "undecided"
    assert evidence.reason.startswith("not decided on the coverage bound: 2 rollouts of the window have total "
                                      "rewards outside the range [0, 1] the coverage bound assumes (from 2 to 2")
    assert "lower end 0.0000 >= -margin -0.05" in evidence.reason  # what it would have been
    assert evidence.tags()["gate.decision"] == "undecided"


def test_with_both_versions_covered_the_range_takes_no_part_and_the_decision_stands():
    """The same rewards, champion ratios 1, 1.5, 1, 1.5 (mean 1.25: coverage 1): u = 0.2, 0.3, 0.2, 0.3,
    V_champ 0.8, V_cand 1, D 0.2; se^2 = 4 * 0.01^2 (per rollout 0.25 - 0.24): se 0.02, promoted as
    without a range."""
    rewards = torch.tensor([2.0, 0.0, 2.0, 0.0])
    champion = torch.log(torch.tensor([1.0, 1.5, 1.0, 1.5]))
    evidence = decide(rewards, torch.zeros(4), champion, BOUNDED)
    assert evidence.decision == "promoted" and evidence.difference == pytest.approx(0.2)
    assert evidence.low == pytest.approx(0.2 - Z90 * 0.02)
    assert evidence.reason == decide(rewards, torch.zeros(4), champion, UNBOUNDED).reason


def test_without_a_finite_range_the_unseen_mass_is_unbounded_and_says_so():
    """A range of (-inf, inf): the champion with a tenth covered lies anywhere, the interval is
    [-inf, inf], undecided, with the reason; well-covered versions (the hand case above, coverage 1
    both) keep the plain interval 1/6 +- z/36 (0 * inf made it NaN, refused)."""
    infinite = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05, reward_min=-math.inf,
                            reward_max=math.inf)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    evidence = decide(rewards, torch.zeros(4), torch.full((4,), math.log(0.1)), infinite)
    assert (evidence.low, evidence.high) == (-math.inf, math.inf) and evidence.decision == "undecided"
    assert evidence.reason.startswith("not decided on the coverage bound: no finite bound on a rollout's total "
                                      "reward is known (range [-inf, inf])")
    covered = decide(rewards, torch.log(torch.tensor([2.0, 1.0, 2.0, 1.0])), torch.zeros(4), infinite)
    assert covered.decision == "promoted" and covered.low == pytest.approx(1 / 6 - Z90 / 36)
