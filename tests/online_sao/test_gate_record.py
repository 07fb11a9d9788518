"""The champion's record (online_sao/gate_record.py) against hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest
import torch

from online_sao.gate import GateSettings, decide, snis_standard_error
from online_sao.gate_record import (ValueRecord, candidate_record, champion_record, champion_unscorable,
                                    comparable, decide_against_record, measure)

SETTINGS = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05)
Z90 = 1.6448536269514722
"""Two-sided 90% normal quantile."""

THIRTY_OF_FORTY = torch.tensor([1.0] * 30 + [0.0] * 10)
"""40 rollouts, 30 rewarded: with equal weights V = 0.75 and se = sqrt(30 * 0.25^2 + 10 * 0.75^2) / 40."""
SE_THIRTY_OF_FORTY = math.sqrt(7.5) / 40


def test_standard_error_of_one_estimate_by_hand():
    # weights 2 and 1: u = 2/3, 1/3; V = 2/3; se^2 = (2/3)^2 (1/3)^2 + (1/3)^2 (2/3)^2 = 8/81
    assert snis_standard_error(torch.tensor([1.0, 0.0]), torch.log(torch.tensor([2.0, 1.0]))) \
        == pytest.approx(math.sqrt(8 / 81))
    assert snis_standard_error(THIRTY_OF_FORTY, torch.zeros(40)) == pytest.approx(SE_THIRTY_OF_FORTY)
    # a cap at 1.5 makes the weights 1.5 and 1: u = 0.6, 0.4; se^2 = 0.6^2 0.4^2 + 0.4^2 0.6^2
    assert snis_standard_error(torch.tensor([1.0, 0.0]), torch.log(torch.tensor([2.0, 1.0])), clip=1.5) \
        == pytest.approx(math.sqrt(2 * 0.36 * 0.16))


def test_record_round_trips_through_registry_tags():
    record = ValueRecord(0.625, 0.0625, 37, 21.5, (40, 49))
    tags = record.tags()
    assert tags["record.window_versions"] == "40-49" and tags["record.n"] == "37"
    assert ValueRecord.from_tags({**tags, "gate.decision": "promoted"}) == record
    assert ValueRecord.from_tags({"gate.decision": "drift_restart"}) is None


def test_against_a_record_promotes_when_clearly_not_worse():
    evidence = decide_against_record(THIRTY_OF_FORTY, torch.zeros(40), ValueRecord(0.5, 0.05, 40, 30.0, (3, 5)),
                                     SETTINGS, window=(8, 9))
    half = Z90 * math.hypot(SE_THIRTY_OF_FORTY, 0.05)  # disjoint rollouts: the variances add
    assert evidence.decision == "promoted" and evidence.basis == "record"
    assert evidence.difference == pytest.approx(0.25)
    assert (evidence.low, evidence.high) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    assert evidence.candidate_se == pytest.approx(SE_THIRTY_OF_FORTY) and evidence.champion_se == 0.05
    tags = evidence.tags()
    assert tags["gate.basis"] == "record" and tags["gate.record_window_versions"] == "3-5"
    assert tags["gate.window_versions"] == "8-9" and tags["gate.champion_value"] == "0.5"


def test_against_a_record_never_rolls_back():
    far_below = decide_against_record(THIRTY_OF_FORTY, torch.zeros(40), ValueRecord(0.95, 0.05, 40, 30.0, (3, 5)),
                                      SETTINGS)
    half = Z90 * math.hypot(SE_THIRTY_OF_FORTY, 0.05)
    assert -0.2 + half < -0.05  # on the same window this interval would roll the candidate back
    assert far_below.decision == "undecided" and "record cannot roll back" in far_below.reason
    straddling = decide_against_record(THIRTY_OF_FORTY, torch.zeros(40), ValueRecord(0.8, 0.05, 40, 30.0, (3, 5)),
                                       SETTINGS)
    assert straddling.decision == "undecided" and straddling.low < -0.05 < straddling.high


def test_against_a_record_still_needs_the_candidates_own_floors():
    record = ValueRecord(0.1, 0.01, 40, 30.0, (1, 2))
    few = decide_against_record(torch.ones(3), torch.zeros(3), record, SETTINGS)
    assert (few.decision, few.reason) == ("refused", "n=3 < min_rollouts=4 (champion's record)")
    # one rollout carries the candidate's estimate: ESS about 1 < 2
    lopsided = decide_against_record(torch.ones(5), torch.tensor([0.0, -30.0, -30.0, -30.0, -30.0]), record,
                                     SETTINGS)
    assert lopsided.decision == "refused" and lopsided.reason.startswith("ess=1.00")
    empty = decide_against_record(torch.zeros(0), torch.zeros(0), record, SETTINGS)
    assert empty.decision == "refused" and empty.n == 0


def test_which_refusals_a_record_may_decide_and_which_sides_become_records():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    even = torch.zeros(5)
    far = torch.tensor([0.0, -30.0, -30.0, -30.0, -30.0])  # one rollout carries everything: ESS about 1
    stale_champion = decide(rewards, even, far, SETTINGS, window=(6, 7))
    assert stale_champion.decision == "refused" and champion_unscorable(stale_champion, SETTINGS)
    assert champion_record(stale_champion, SETTINGS) is None  # under the floor: not a measurement to keep
    stale_candidate = decide(rewards, far, even, SETTINGS)
    assert stale_candidate.decision == "refused" and not champion_unscorable(stale_candidate, SETTINGS)
    assert candidate_record(stale_candidate, SETTINGS) is None
    too_few = decide(rewards[:3], far[:3], far[:3], SETTINGS)
    assert not champion_unscorable(too_few, SETTINGS)
    both = decide(rewards, even, even, SETTINGS, window=(6, 7))
    assert both.decision == "promoted" and not champion_unscorable(both, SETTINGS)
    # equal weights on 5 rollouts, 3 rewarded: V = 0.6, se = sqrt(3 * 0.4^2 + 2 * 0.6^2) / 5, ESS 5
    expected = ValueRecord(0.6, math.sqrt(3 * 0.16 + 2 * 0.36) / 5, 5, 5.0, (6, 7))
    for found in (candidate_record(both, SETTINGS), champion_record(both, SETTINGS)):
        assert found is not None
        assert (found.n, found.window) == (expected.n, expected.window)
        assert (found.value, found.se, found.ess) == (pytest.approx(expected.value), pytest.approx(expected.se),
                                                      pytest.approx(expected.ess))
    on_record = decide_against_record(rewards, even, ValueRecord(0.5, 0.1, 40, 30.0, (1, 2)), SETTINGS)
    assert champion_record(on_record, SETTINGS) is None  # nothing new was measured on the champion


def test_the_record_is_read_from_its_one_tag_whatever_the_readable_tags_say():
    """A refresh stopped after the readable tags (one registry call each) and before ``record``
    leaves those new and ``record`` old: the old record is read whole, not a mix of the two."""
    old, new = ValueRecord(0.625, 0.0625, 37, 21.5, (40, 49)), ValueRecord(0.25, 0.125, 50, 30.0, (50, 59))
    cut_short = {**old.tags(), **{key: value for key, value in new.tags().items() if key != "record"}}
    assert cut_short["record.value"] == "0.25" and ValueRecord.from_tags(cut_short) == old
    assert ValueRecord.from_tags({**cut_short, "record": new.tags()["record"]}) == new
    assert json.loads(new.tags()["record"]) == {"value": 0.25, "se": 0.125, "n": 50, "ess": 30.0, "window": [50, 59],
                                                "reward_definition": "", "coverage": 1.0}
    assert list(new.tags())[-1] == "record"  # written last


def test_an_unreadable_record_tag_is_no_record_and_is_named(caplog):
    tags = ValueRecord(0.625, 0.0625, 37, 21.5, (40, 49)).tags()
    with caplog.at_level("WARNING", logger="online_sao.gate_record"):
        for bad in ("{", "[1, 2]", '{"value": 0.5}', '{"value": 0.5, "se": 0.1, "n": 3, "ess": 2.0, "window": [4]}'):
            assert ValueRecord.from_tags({**tags, "record": bad}) is None
    assert caplog.text.count("unreadable") == 4


def test_an_incomplete_or_unreadable_legacy_record_is_no_record_and_is_named(caplog):
    """Older code wrote only the ``record.*`` tags, one registry call each: a learner stopped after
    two of them left a record the next decision used to crash on (KeyError, at every restart)."""
    tags = {key: value for key, value in ValueRecord(0.625, 0.0625, 37, 21.5, (40, 49)).tags().items()
            if key != "record"}
    cut_short = {key: tags[key] for key in ("record.value", "record.se")}
    with caplog.at_level("WARNING", logger="online_sao.gate_record"):
        assert ValueRecord.from_tags({**cut_short, "gate.decision": "promoted"}) is None
    assert "missing record.n, record.ess, record.window_versions" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="online_sao.gate_record"):
        assert ValueRecord.from_tags({**tags, "record.window_versions": "40"}) is None
        assert ValueRecord.from_tags({**tags, "record.n": "thirty"}) is None
    assert caplog.text.count("unreadable") == 2 and "thirty" in caplog.text
    caplog.clear()
    assert ValueRecord.from_tags({"gate.decision": "drift_restart"}) is None and caplog.text == ""  # none: quiet


UNDER_A = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05, reward_definition="a" * 16)
UNDER_B = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05, reward_definition="b" * 16)


def test_records_carry_the_reward_definition_they_were_measured_under():
    measured = measure(THIRTY_OF_FORTY, torch.zeros(40), UNDER_A, (3, 5))
    assert (measured.value, measured.se, measured.n, measured.ess) == pytest.approx((0.75, SE_THIRTY_OF_FORTY, 40, 40.0))
    assert (measured.window, measured.reward_definition) == ((3, 5), "a" * 16)
    evidence = decide(THIRTY_OF_FORTY, torch.zeros(40), torch.zeros(40), UNDER_A, (3, 5))
    assert candidate_record(evidence, UNDER_A).reward_definition == "a" * 16
    assert champion_record(evidence, UNDER_A).reward_definition == "a" * 16
    tags = measured.tags()
    assert tags["record.reward_definition"] == "a" * 16 and ValueRecord.from_tags(tags) == measured
    readable_only = {key: value for key, value in tags.items() if key != "record"}  # a write cut short
    assert ValueRecord.from_tags(readable_only) == measured


def test_a_record_under_other_rewards_is_not_decided_on():
    """A record of 0.2 under definition a; the gate now decides under b, where the candidate's 0.75
    would be promoted against it (0.75 - 0.2 is far above -margin) whatever b's scale is."""
    record = ValueRecord(0.2, 0.05, 40, 30.0, (1, 2), "a" * 16)
    assert comparable(record, UNDER_A) and not comparable(record, UNDER_B)
    assert decide_against_record(THIRTY_OF_FORTY, torch.zeros(40), record, UNDER_A).decision == "promoted"
    with pytest.raises(ValueError, match="measured under reward definition a{16}, the gate decides under b{16}"):
        decide_against_record(THIRTY_OF_FORTY, torch.zeros(40), record, UNDER_B)


def test_a_record_or_gate_without_a_definition_is_taken_as_comparable():
    """Records written before definitions were kept have none: they are read as measured under the
    current rewards (an upgrade is not a reward change); a gate that does not know its rewards'
    definition (benchmarks, tests) compares every record."""
    legacy = {"record": json.dumps({"value": 0.5, "se": 0.05, "n": 40, "ess": 30.0, "window": [1, 2]})}
    old = ValueRecord.from_tags(legacy)
    assert old == ValueRecord(0.5, 0.05, 40, 30.0, (1, 2), "") and comparable(old, UNDER_B)
    assert comparable(ValueRecord(0.5, 0.05, 40, 30.0, (1, 2), "a" * 16), SETTINGS)


def test_against_a_record_a_window_whose_totals_break_the_range_decides_nothing_on_the_coverage_bound():
    """Totals of 2 (two rewards of 1 summed) against the range [0, 1]; the record covered half its
    version (coverage 0.5, value 0.9, se 0): its value "in" 0.45 + 0.5 [0, 1] = [0.45, 0.95]. The
    candidate: 1600 rollouts, rewards 2 and 0 alternating, even weights: V 1, se sqrt(1600) / 1600 =
    0.025; lower end 1 - 0.95 - z 0.025 = 0.0089 >= -0.05: promoted before, on a bound the window
    shows false (its unseen half may earn 2)."""
    bounded = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05, reward_min=0.0,
                           reward_max=1.0)
    record = ValueRecord(0.9, 0.0, 40, 30.0, (3, 5), coverage=0.5)
    rewards = torch.tensor([2.0, 0.0] * 800)
    evidence = decide_against_record(rewards, torch.zeros(1600), record, bounded)
    assert evidence.low == pytest.approx(1.0 - 0.95 - Z90 * 0.025)
    assert evidence.decision == "undecided"
    assert evidence.reason.startswith("not decided on the coverage bound: 800 rollouts of the window have total "
                                      "rewards outside the range [0, 1]")
    assert "lower end" in evidence.reason and evidence.reason.endswith("(champion's record)")
