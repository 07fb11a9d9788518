"""The critic-fit benchmark's measures on hand-built batches."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from benchmarks.critic_fit import FitSpec, OnlineSpec, action_positions, explained_variance_on_test as measure


class _Batch:
    def __init__(self, action_mask: list[list[bool]]) -> None:
        self.action_mask = torch.tensor(action_mask)


def test_first_and_last_action_token_of_each_row():
    mask = torch.tensor([[False, True, True, False], [True, False, False, True], [False, False, False, True]])
    first, last = action_positions(mask)
    assert first.tolist() == [1, 0, 3]
    assert last.tolist() == [2, 3, 3]


def test_a_row_without_an_action_token_is_refused():
    with pytest.raises(ValueError, match="action token"):
        action_positions(torch.tensor([[True, False], [False, False]]))


def test_explained_variance_at_the_first_last_and_all_action_tokens():
    # Two answers, rewards 1 and 0. The critic knows nothing at the first action token (0.5
    # both) and the reward at the last; a prompt token (not an action) is never counted.
    batch = _Batch([[False, True, True, True], [False, True, True, True]])
    values = torch.tensor([[9.0, 0.5, 0.75, 1.0], [-9.0, 0.5, 0.25, 0.0]])
    ev = measure(values, batch, torch.tensor([1.0, 0.0]))
    assert ev["first_token"] == pytest.approx(0.0)  # 1 - Var(0.5, -0.5) / Var(1, 0) = 1 - 0.25 / 0.25
    assert ev["last_token"] == pytest.approx(1.0)
    # errors over the six action tokens: 0.5, 0.25, 0, -0.5, -0.25, 0: variance 0.3125 / 3 -> 0.104166...
    # targets 1, 1, 1, 0, 0, 0: variance 0.25
    assert ev["all_tokens"] == pytest.approx(1 - (0.3125 / 3) / 0.25)


def test_equal_rewards_leave_explained_variance_undefined():
    batch = _Batch([[True, True], [True, True]])
    ev = measure(torch.zeros(2, 2), batch, torch.tensor([0.5, 0.5]))
    assert math.isnan(ev["last_token"])


def test_fit_specs_parse_and_refuse_an_unknown_attention_setting():
    assert FitSpec.parse("64:1.5e-3:frozen") == FitSpec(64, 1.5e-3, True)
    assert FitSpec.parse("500:5e-4:trained") == FitSpec(500, 5e-4, False)
    with pytest.raises(argparse.ArgumentTypeError):
        FitSpec.parse("64:1e-3:thawed")


def test_online_specs_parse_and_refuse_an_unknown_order():
    assert OnlineSpec.parse("512:judge_then_fit:4") == OnlineSpec(512, "judge_then_fit", 4)
    with pytest.raises(argparse.ArgumentTypeError):
        OnlineSpec.parse("512:judge_first:4")
