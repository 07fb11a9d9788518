"""The promotion gate's estimator and decision rule against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from online_sao.gate import (GateSettings, canary_difference, decide, decide_canary, effective_sample_size,
                             importance_weights, paired_difference, sequence_log_ratio, snis_estimate, verdict)

SETTINGS = GateSettings(min_rollouts=4, min_ess=2.0, confidence=0.9, margin=0.05)


def test_sequence_log_ratio_sums_action_tokens_only():
    target = torch.tensor([[0.0, -1.0, -2.0, -9.0], [0.0, -0.5, -0.5, 0.0]])
    behaviour = torch.tensor([[0.0, -1.5, -1.0, -1.0], [0.0, -0.5, -1.5, 0.0]])
    mask = torch.tensor([[False, True, True, False], [False, True, True, False]])
    # row 0: (-1 + 1.5) + (-2 + 1) = -0.5 (the -9 is not an action); row 1: 0 + 1 = 1
    assert sequence_log_ratio(target, behaviour, mask).tolist() == [-0.5, 1.0]


def test_weights_estimate_and_ess_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    log_ratio = torch.tensor([math.log(3.0), 0.0])
    weights, metrics = importance_weights(log_ratio)
    assert weights.tolist() == pytest.approx([1.0, 1 / 3])  # scaled so the largest is 1
    value, m = snis_estimate(rewards, log_ratio)
    assert value == pytest.approx(3 / 4)  # (3 * 1 + 1 * 0) / 4
    assert m["ess"] == pytest.approx(16 / 10)  # (3 + 1)^2 / (9 + 1)
    assert metrics["clipped_frac"] == 0.0


def test_clipping_caps_the_ratio_before_normalising():
    rewards = torch.tensor([1.0, 0.0])
    log_ratio = torch.tensor([math.log(3.0), 0.0])
    value, m = snis_estimate(rewards, log_ratio, clip=2.0)
    assert value == pytest.approx(2 / 3)  # weights 2 and 1
    assert m["ess"] == pytest.approx(9 / 5)
    assert m["clipped_frac"] == 0.5


def test_huge_log_ratios_do_not_overflow():
    value, m = snis_estimate(torch.tensor([1.0, 0.0]), torch.tensor([2000.0, 1000.0]))
    assert value == pytest.approx(1.0) and m["ess"] == pytest.approx(1.0)


def test_equal_weights_give_the_plain_mean_and_full_ess():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5])
    value, m = snis_estimate(rewards, torch.full((4,), -7.0))
    assert value == pytest.approx(0.625) and m["ess"] == pytest.approx(4.0)
    assert effective_sample_size(torch.tensor([0.0, 0.0, 2.0])) == pytest.approx(1.0)


def test_paired_difference_and_its_standard_error_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    candidate = torch.log(torch.tensor([2.0, 1.0, 2.0, 1.0]))  # u = 1/3, 1/6, ...: V = 2/3
    champion = torch.zeros(4)  # u = 1/4 each: V = 1/2
    diff, se, m = paired_difference(rewards, candidate, champion)
    assert (m["candidate_value"], m["champion_value"]) == (pytest.approx(2 / 3), pytest.approx(1 / 2))
    assert diff == pytest.approx(1 / 6)
    # per rollout: 1/3 * (1 - 2/3) - 1/4 * (1 - 1/2) = -1/72, then +1/72, -1/72, +1/72
    assert se == pytest.approx(math.sqrt(4 / 72 ** 2))
    assert m["candidate_ess"] == pytest.approx(36 / 10) and m["champion_ess"] == pytest.approx(4.0)


def test_decide_end_to_end_on_the_hand_case():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    candidate = torch.log(torch.tensor([2.0, 1.0, 2.0, 1.0]))
    evidence = decide(rewards, candidate, torch.zeros(4), SETTINGS, window=(3, 7))
    z = 1.6448536269514722  # two-sided 90 %
    assert evidence.low == pytest.approx(1 / 6 - z / 36) and evidence.high == pytest.approx(1 / 6 + z / 36)
    assert evidence.decision == "promoted" and evidence.n == 4
    tags = evidence.tags()
    assert tags["gate.decision"] == "promoted" and tags["gate.window_versions"] == "3-7"
    assert float(tags["gate.difference"]) == pytest.approx(1 / 6) and tags["gate.n"] == "4"
    # roles swapped: the candidate trails by 1/6 +- 0.046, the whole interval below -0.05
    assert decide(rewards, torch.zeros(4), candidate, SETTINGS).decision == "rolled_back"


def test_decide_refuses_below_the_ess_floor_and_on_an_empty_window():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    one_carries_all = torch.tensor([0.0, -50.0, -50.0, -50.0])
    evidence = decide(rewards, one_carries_all, torch.zeros(4), SETTINGS)
    assert evidence.decision == "refused" and "ess" in evidence.reason
    assert evidence.candidate_ess == pytest.approx(1.0)
    assert decide(torch.zeros(0), torch.zeros(0), torch.zeros(0), SETTINGS).decision == "refused"


@pytest.mark.parametrize(("n", "ess", "low", "high", "expected"), [
    (3, 4.0, 0.0, 0.1, "refused"),          # one rollout short of min_rollouts
    (4, 4.0, 0.0, 0.1, "promoted"),         # exactly min_rollouts decides
    (4, 1.99, 0.0, 0.1, "refused"),         # just below the ESS floor
    (4, 2.0, 0.0, 0.1, "promoted"),         # exactly at the floor decides
    (4, 4.0, -0.05, 0.1, "promoted"),       # lower end exactly at -margin: not inferior
    (4, 4.0, -0.0501, 0.1, "undecided"),    # just past it: straddles
    (4, 4.0, -0.3, -0.05, "undecided"),     # upper end exactly at -margin: not shown worse
    (4, 4.0, -0.3, -0.0501, "rolled_back"),  # whole interval below -margin
])
def test_verdict_at_its_edges(n, ess, low, high, expected):
    assert verdict(n, ess, low, high, SETTINGS)[0] == expected


def test_canary_difference_and_its_standard_error_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    log_ratio = torch.tensor([0.0, 0.0, math.log(2.0), math.log(2.0)])  # weights 1, 1, 2, 2: u = 1/6, 1/6, 1/3, 1/3
    canary = torch.tensor([0.0, 1.0, 0.0, 0.0])
    diff, se, m = canary_difference(rewards, log_ratio, canary)
    assert m["candidate_value"] == pytest.approx(5 / 6)  # 1/6 + 1/3 + 1/3
    assert m["champion_value"] == pytest.approx(0.25)  # the plain mean of its own answers
    assert m["candidate_ess"] == pytest.approx(9 / 2.5) and m["champion_ess"] == 4.0  # (1+1+2+2)^2 / (1+1+4+4)
    assert diff == pytest.approx(7 / 12)
    # candidate: (u (r - 5/6))^2 = (1/36)^2 + (5/36)^2 + (1/18)^2 + (1/18)^2 = 34/1296;
    # canary: ((3 * 0.25^2 + 0.75^2) / 4^2 = 0.75 / 16 = 60.75/1296
    assert se == pytest.approx(math.sqrt(94.75) / 36)


def test_decide_canary_on_the_hand_case_and_at_its_floors():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    log_ratio = torch.tensor([0.0, 0.0, math.log(2.0), math.log(2.0)])
    canary = torch.tensor([0.0, 1.0, 0.0, 0.0])
    settings = GateSettings(min_rollouts=4, min_ess=3.0, confidence=0.9, margin=0.05)
    evidence = decide_canary(rewards, log_ratio, canary, settings, window=(3, 7))
    low = 7 / 12 - 1.6448536269514722 * math.sqrt(94.75) / 36  # about 0.139 >= -0.05
    assert (evidence.decision, evidence.n, evidence.canary_n, evidence.window) == ("promoted", 8, 4, (3, 7))
    assert evidence.low == pytest.approx(low) and evidence.champion_ess == 4.0
    assert evidence.tags()["gate.canary_n"] == "4"
    strict = GateSettings(min_rollouts=4, min_ess=4.0, confidence=0.9, margin=0.05)
    refused = decide_canary(rewards, log_ratio, canary, strict)
    assert (refused.decision, refused.reason) == ("refused", "ess=3.60 < min_ess=4.0")  # the candidate's 3.6
    none = decide_canary(rewards, log_ratio, torch.zeros(0), settings)
    assert (none.decision, none.reason, none.n) == ("refused", "no canary answers of the champion in the window", 4)
    few = decide_canary(rewards[:1], log_ratio[:1], canary[:2], settings)
    assert (few.decision, few.reason) == ("refused", "n=3 < min_rollouts=4")
