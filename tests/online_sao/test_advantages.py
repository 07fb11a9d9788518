import pytest
import torch

import online_sao.advantages as advantages_module
from online_sao.advantages import length_adaptive_lambda, skip_observation_gae, whiten


def reference_gae(rewards, values, action_mask, gamma, lam):
    """Plain loops over rows and action tokens, written straight from SAO.md section 2."""
    b, t = action_mask.shape
    lam = torch.as_tensor(lam, dtype=torch.float64).expand(b)
    advantages = torch.zeros(b, t, dtype=torch.float64)
    for row in range(b):
        positions = [p for p in range(t) if action_mask[row, p]]
        if not positions:
            continue
        credit = [0.0] * len(positions)
        for p in range(t):
            before = [j for j, q in enumerate(positions) if q <= p]
            credit[before[-1] if before else 0] += float(rewards[row, p])
        running = 0.0
        for j in reversed(range(len(positions))):
            next_value = float(values[row, positions[j + 1]]) if j + 1 < len(positions) else 0.0
            delta = credit[j] + gamma * next_value - float(values[row, positions[j]])
            running = delta + gamma * float(lam[row]) * running
            advantages[row, positions[j]] = running
    returns = torch.where(action_mask, advantages + values.double(), torch.zeros_like(advantages))
    return advantages, returns


def test_single_segment_literal():
    mask = torch.tensor([[False, True, True, True]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 0.75]])  # the prompt's value 9 must be ignored
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # d3 = 1 + 0 - 0.75 = 0.25               A3 = 0.25
    # d2 = 0 + 0.75 - 0.25 = 0.5             A2 = 0.5 + 0.5 * 0.25 = 0.625
    # d1 = 0 + 0.25 - 0.5 = -0.25            A1 = -0.25 + 0.5 * 0.625 = 0.0625
    assert adv.tolist() == [[0.0, 0.0625, 0.625, 0.25]]
    # returns = A + V = [0.5625, 0.875, 1.0]
    assert ret.tolist() == [[0.0, 0.5625, 0.875, 1.0]]


def test_multi_segment_literal_with_observation_reward():
    # prompt | action action | obs obs | action | obs (final reward sits on the trailing observation)
    mask = torch.tensor([[False, True, True, False, False, True, False]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.0, 1.0, 2.0, 100.0, 100.0, 4.0, 100.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # action tokens j = 1, 2, 3 at positions 1, 2, 5; V = [1, 2, 4]
    # credit: the observation reward 2 (pos 3) -> j = 2; the final reward 1 (pos 6) -> j = 3
    # d3 = 1 + 0.5 * 0 - 4 = -3      A3 = -3
    # d2 = 2 + 0.5 * 4 - 2 = 2       A2 = 2 + 0.5 * 1 * -3 = 0.5
    # d1 = 0 + 0.5 * 2 - 1 = 0       A1 = 0 + 0.5 * 0.5 = 0.25
    assert adv.tolist() == [[0.0, 0.25, 0.5, 0.0, 0.0, -3.0, 0.0]]
    # lambda = 1: returns are discounted Monte-Carlo: G3 = 1, G2 = 2 + 0.5 * 1, G1 = 0.5 * 2.5
    assert ret.tolist() == [[0.0, 1.25, 2.5, 0.0, 0.0, 1.0, 0.0]]


def test_observation_tokens_only_move_reward_credit():
    mask = torch.tensor([[False, True, True, False, False, True, False]])
    values = torch.tensor([[0.0, 1.0, 2.0, 100.0, 100.0, 4.0, 100.0]])
    on_observation = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 1.0]])
    on_credited_action = torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0]])
    other_obs_values = torch.tensor([[-5.0, 1.0, 2.0, -7.0, 3.0, 4.0, 0.0]])
    base = skip_observation_gae(on_observation, values, mask, 0.9, 0.7)
    for rewards, vals in [(on_credited_action, values), (on_observation, other_obs_values)]:
        adv, ret = skip_observation_gae(rewards, vals, mask, 0.9, 0.7)
        torch.testing.assert_close(adv, base[0])
        torch.testing.assert_close(ret, base[1])


def test_gamma_lambda_one_telescopes_to_return_minus_value():
    # A_j = sum_{k >= j} (rho_k + V_{k+1} - V_k) = (sum of rewards from j on) - V_j
    mask = torch.tensor([[False, True, False, True, True]])
    rewards = torch.tensor([[0.0, 1.0, 3.0, 0.0, 2.0]])  # the 3 on the observation goes to position 1
    values = torch.tensor([[0.0, 0.5, 0.0, 1.5, -1.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, 1.0, 1.0)
    # position 1: (1 + 3 + 2) - 0.5 = 5.5; position 3: 2 - 1.5 = 0.5; position 4: 2 - (-1) = 3
    assert adv.tolist() == [[0.0, 5.5, 0.0, 0.5, 3.0]]
    assert ret.tolist() == [[0.0, 6.0, 0.0, 2.0, 2.0]]


def test_under_bfloat16_autocast_the_solve_keeps_float32():
    """The one-process learner runs its step under bfloat16 autocast, which lowers ``bmm``: the
    Monte-Carlo targets (gamma = lambda = 1) of a reward 1 on the last of 500 action tokens are 1
    on every one of them, whatever the values; in bfloat16 they came out 0.99996 to 1.0019."""
    mask = torch.zeros(1, 600, dtype=torch.bool)
    mask[0, 100:] = True
    values = 0.5 + 0.01 * torch.randn(1, 600, generator=torch.Generator().manual_seed(0)).cumsum(1)
    rewards = torch.zeros(1, 600)
    rewards[0, -1] = 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, returns = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert returns.dtype == torch.float32
    assert returns[mask] == pytest.approx(torch.ones(500), abs=1e-5)


def test_reward_before_first_action_goes_to_first_action_and_empty_rows_are_zero():
    mask = torch.tensor([[False, False, True, True], [False, False, False, False]])
    rewards = torch.tensor([[4.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 7.0]])
    values = torch.ones(2, 4)
    adv, ret = skip_observation_gae(rewards, values, mask, 1.0, 1.0)
    # row 0: credit [4, 1]; A1 = (4 + 1) - 1 = 4, A2 = 1 - 1 = 0
    assert adv[0].tolist() == [0.0, 0.0, 4.0, 0.0]
    assert ret[0].tolist() == [0.0, 0.0, 5.0, 1.0]
    assert adv[1].tolist() == [0.0] * 4 and ret[1].tolist() == [0.0] * 4


def _random_multi_segment_batch(seed: int, b: int = 6, t: int = 40):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row in range(b):
        pos = int(torch.randint(1, 6, (1,), generator=gen))  # prompt length
        while pos < t:
            seg = int(torch.randint(1, 8, (1,), generator=gen))
            mask[row, pos:pos + seg] = True
            pos += seg + int(torch.randint(1, 6, (1,), generator=gen))  # an observation follows
    mask[-1] = False  # one row without any action
    rewards = torch.randn(b, t, generator=gen) * (torch.rand(b, t, generator=gen) < 0.2)
    values = torch.randn(b, t, generator=gen)
    lam = torch.rand(b, generator=gen)
    lam[0] = 1.0
    lam[1] = 0.0
    return rewards, values, mask, lam


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("block", [3, 128])
def test_vectorised_gae_matches_plain_loop(seed, block, monkeypatch):
    # block 3 forces many chained blocks; 128 solves each row in one block
    monkeypatch.setattr(advantages_module, "GAE_BLOCK", block)
    rewards, values, mask, lam = _random_multi_segment_batch(seed)
    gamma = 0.95 if seed % 2 else 1.0
    adv, ret = skip_observation_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all())


def test_length_adaptive_lambda_literals():
    lam = length_adaptive_lambda(torch.tensor([0, 1, 2, 3, 10]), alpha=1.5)
    # l = 0: 1 - 1/0 = -inf -> clamped to 0; l = 1: 1 - 1/1.5 = 1/3; l = 2: 1 - 1/3; l = 3: 1 - 1/4.5; l = 10: 1 - 1/15
    torch.testing.assert_close(lam, torch.tensor([0.0, 1 / 3, 2 / 3, 7 / 9, 14 / 15]))
    # alpha = 0.5, l = 1: 1 - 1/0.5 = -1 -> clamped to 0
    assert length_adaptive_lambda(torch.tensor([1]), alpha=0.5).tolist() == [0.0]


def test_whiten_over_action_tokens_only():
    mask = torch.tensor([[False, True, True], [False, True, False]])
    adv = torch.tensor([[50.0, 1.0, 2.0], [-9.0, 3.0, 8.0]])
    out = whiten(adv, mask)
    # action values [1, 2, 3]: mean 2, population std sqrt(2/3)
    expected = torch.tensor([-1.0, 0.0, 1.0]) / (2 / 3) ** 0.5
    torch.testing.assert_close(out[mask], expected)
    assert out[~mask].tolist() == [0.0, 0.0, 0.0]


def _recording(into: list):
    """A SumOverRanks of one process that keeps what it was given (a rank's own moments)."""
    def sum_over_ranks(moments: torch.Tensor) -> torch.Tensor:
        into.append(moments.clone())
        return moments
    return sum_over_ranks


def _with_other_rank(other: torch.Tensor):
    """A SumOverRanks of two ranks whose peer contributed ``other``."""
    return lambda moments: moments + other


def test_whiten_with_a_second_rank_equals_whitening_the_concatenation():
    generator = torch.Generator().manual_seed(0)
    adv_a = torch.randn(2, 5, generator=generator) * 3 + 1
    mask_a = torch.tensor([[False, True, True, True, False], [True, True, False, True, True]])
    adv_b = torch.randn(3, 4, generator=generator) * 0.5 - 2  # other moments, other padding
    mask_b = torch.tensor([[True, True, False, False], [False, True, True, True], [True, False, False, True]])
    seen_a, seen_b = [], []
    whiten(adv_a, mask_a, _recording(seen_a))
    whiten(adv_b, mask_b, _recording(seen_b))
    assert len(seen_a) == len(seen_b) == 1
    got_a = whiten(adv_a, mask_a, _with_other_rank(seen_b[0]))
    got_b = whiten(adv_b, mask_b, _with_other_rank(seen_a[0]))

    step = torch.cat([adv_a[mask_a], adv_b[mask_b]]).to(torch.float64)
    mean, std = step.mean(), step.std(unbiased=False)
    torch.testing.assert_close(got_a[mask_a], ((adv_a[mask_a] - mean) / std).float())
    torch.testing.assert_close(got_b[mask_b], ((adv_b[mask_b] - mean) / std).float())
    assert got_a[~mask_a].abs().sum() == 0 and got_b[~mask_b].abs().sum() == 0
    # each share whitened alone would give other numbers: the defect two ranks had
    assert (whiten(adv_a, mask_a) - got_a).abs().max() > 0.1


def test_whiten_counts_action_tokens_of_all_ranks():
    # one action token per rank: alone neither is whitened, together they are [3, 5] -> [-1, 1]
    one = torch.tensor([[True]])
    seen_a, seen_b = [], []
    assert whiten(torch.tensor([[3.0]]), one, _recording(seen_a)).tolist() == [[3.0]]
    assert whiten(torch.tensor([[5.0]]), one, _recording(seen_b)).tolist() == [[5.0]]
    assert whiten(torch.tensor([[3.0]]), one, _with_other_rank(seen_b[0])).item() == pytest.approx(-1.0)
    assert whiten(torch.tensor([[5.0]]), one, _with_other_rank(seen_a[0])).item() == pytest.approx(1.0)


def test_a_rank_without_action_tokens_still_takes_part():
    # it must call the collective (its peers wait in it) and contribute nothing to the moments
    none = torch.zeros(1, 3, dtype=torch.bool)
    seen_empty, seen_a = [], []
    out = whiten(torch.tensor([[7.0, 8.0, 9.0]]), none, _recording(seen_empty))
    assert len(seen_empty) == 1 and out.tolist() == [[0.0, 0.0, 0.0]]
    adv_a, mask_a = torch.tensor([[1.0, 2.0, 4.0]]), torch.ones(1, 3, dtype=torch.bool)
    whiten(adv_a, mask_a, _recording(seen_a))
    torch.testing.assert_close(whiten(adv_a, mask_a, _with_other_rank(seen_empty[0])), whiten(adv_a, mask_a))
