"""The promotion gate's estimator and decision rule against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from online_sao.gate import (GateSettings, decide, effective_sample_size, importance_weights, mixture_log_ratios,
                             paired_difference, sequence_log_ratio, snis_estimate, verdict)

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


def test_mixture_log_ratios_by_hand():
    l_cand = torch.tensor([0.0, math.log(0.5)])
    l_champ = torch.tensor([math.log(3.0), 0.0])
    from_canary = torch.tensor([False, True])
    cand, champ = mixture_log_ratios(l_cand, l_champ, from_canary, canary_share=0.25)
    # answer 0, the serving version's: q / mu = 0.75 * 1 + 0.25 * 3 = 1.5 -> 1 / 1.5 and 3 / 1.5
    # answer 1, the champion's (mu = pi_champ): q / mu = 0.75 * 0.5 + 0.25 * 1 = 0.625 -> 0.5 / 0.625 and 1 / 0.625
    assert torch.exp(cand).tolist() == pytest.approx([1 / 1.5, 0.8])
    assert torch.exp(champ).tolist() == pytest.approx([2.0, 1.6])
    same = mixture_log_ratios(l_cand, l_champ, torch.tensor([False, False]), canary_share=0.0)
    assert same[0] is l_cand and same[1] is l_champ  # no canary: the behaviour's own weights


def test_mixture_weights_stay_under_one_over_the_share():
    """However far apart the two versions are, the champion's weight is at most 1/s and, on the
    answers the candidate sampled itself, the candidate's at most 1/(1 - s): the ESS cannot
    collapse onto one answer."""
    l_cand = torch.tensor([0.0, 0.0, -30.0, -25.0])
    l_champ = torch.tensor([-40.0, 20.0, 0.0, 0.0])
    cand, champ = mixture_log_ratios(l_cand, l_champ, torch.tensor([False, False, True, True]), canary_share=0.2)
    assert torch.exp(champ).max() <= 1 / 0.2 + 1e-9 and torch.exp(cand).max() <= 1 / 0.8 + 1e-9
    assert torch.exp(champ)[1:].tolist() == pytest.approx([5.0, 5.0, 5.0], rel=1e-6)  # 20 nats over: about 1/s


def test_a_pool_the_champion_answered_alone_weighs_the_candidate_against_it():
    l_cand, l_champ = torch.tensor([-1.0, 0.5]), torch.tensor([0.0, 0.0])  # the champion sampled both
    cand, champ = mixture_log_ratios(l_cand, l_champ, torch.tensor([True, True]), canary_share=1.0)
    assert cand.tolist() == [-1.0, 0.5] and champ.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="canary_share must lie in"):
        mixture_log_ratios(l_cand, l_champ, torch.tensor([True, True]), canary_share=1.5)
