"""Data-parallel training: two gloo ranks with FSDP2 end where one process ends.

The equivalence test launches tests/trainer/fsdp_worker.py under torchrun with two
CPU ranks and runs the same worker in this process as the reference (world size 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from online_sao.algorithms import build_optimizers
from online_sao.baselines import RunningMean
from online_sao.batch import Rollout, collate, step_rewards
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from tests.conftest import _free_port
from tests.trainer import fsdp_worker
from trainer.distributed import (
    DistContext,
    decoder_layers,
    global_token_normalizer,
    reduce_metrics,
    shard_rollouts,
    shard_units,
)
from trainer.full_state import KERNEL_FLAGS, load_optimizer_state, optimizer_state

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = REPO_ROOT / "tests" / "trainer" / "fsdp_worker.py"

WEIGHT_ATOL = 1e-7
WEIGHT_RTOL = 1e-6
"""Float32 tolerance of the 2-rank weights. The two runs add the same numbers in a
different order: each rank pads to its own longest rollout (other matmul shapes)
and gradients are summed per rank, then averaged by FSDP's reduce-scatter. That
perturbs gradients by about 1e-6 relative; AdamW divides the gradient by its own
running scale, so weights move by about lr (1e-5) per step and differ by about
1e-9 (measured 2e-9 to 4e-9). 1e-7 is 1% of one step's movement, plus one float32
ulp for weights near 1 (norms). A wrong normaliser (each rank dividing by its own
token count) was measured to move weights by 1.7e-5, far outside."""

BF16_UPDATE_RTOL = 0.2
"""Relative distance of the 2-rank bfloat16-compute update (all parameters) from the float32
process's: measured 0.049 (bfloat16's rounding of activations and gradients); an update that
rounded away would be off by most of itself."""
STATE_RTOL = 1e-4
"""Optimiser moments and gradient norms are linear in the gradients, so they carry
the same ~1e-6 relative rounding; 1e-4 relative to each tensor's largest entry."""



def _ctx(rank: int, world_size: int) -> DistContext:
    return DistContext(rank=rank, world_size=world_size, device=torch.device("cpu"))


def _rollout(iid: str, actions: int, prompt: int = 2, group_id: int = -1, reward: float = 1.0) -> Rollout:
    n = prompt + actions
    mask = [False] * prompt + [True] * actions
    return Rollout(iid, list(range(1, n + 1)), mask, [-0.5 if m else 0.0 for m in mask], [3] * n, {n - 1: reward},
                   group_id=group_id)


def test_shard_rollouts_gives_each_rollout_to_one_rank_balanced_by_tokens():
    rollouts = [_rollout(f"r{i}", a) for i, a in enumerate([9, 1, 1, 4, 4, 1])]
    shares = [shard_rollouts(rollouts, _ctx(rank, 2)) for rank in range(2)]
    ids = [[r.interaction_id for r in share] for share in shares]
    assert sorted(ids[0] + ids[1]) == sorted(r.interaction_id for r in rollouts)
    # largest first to the least-loaded rank (ties: lower rank): r0(9) -> 0; r3(4), r4(4), r1(1) -> 1;
    # r2(1) -> 0 (9 vs 9); r5(1) -> 1. Shares keep list order.
    assert ids == [["r0", "r2"], ["r1", "r3", "r4", "r5"]]
    assert [sum(r.num_action_tokens for r in s) for s in shares] == [10, 10]
    assert shard_rollouts(rollouts, _ctx(0, 2)) == shares[0]  # deterministic


def test_shard_rollouts_needs_a_rollout_per_rank():
    with pytest.raises(ValueError, match="at least world_size"):
        shard_rollouts([_rollout("a", 2)], _ctx(0, 2))
    assert shard_rollouts([_rollout("a", 2)], _ctx(0, 1))[0].interaction_id == "a"
    with pytest.raises(ValueError, match="at least world_size"):  # one group: one rank would have nothing
        shard_rollouts([_rollout("a", 2, group_id=0), _rollout("b", 2, group_id=0)], _ctx(0, 2))


def test_shard_rollouts_keeps_every_grpo_group_on_one_rank():
    # token balancing alone would give g0's 9-token member to one rank and its 1-token members to the other
    sizes = {"a0": (9, 0), "a1": (1, 0), "a2": (1, 0), "b0": (4, 1), "b1": (4, 1), "b2": (1, 1), "c0": (2, 2)}
    rollouts = [_rollout(iid, actions, group_id=group) for iid, (actions, group) in sizes.items()]
    shares = [[r.interaction_id for r in shard_rollouts(rollouts, _ctx(rank, 2))] for rank in range(2)]
    # whole groups, largest first: g0 (11) -> 0, g1 (9) -> 1, g2 (2) -> 1
    assert shares == [["a0", "a1", "a2"], ["b0", "b1", "b2", "c0"]]
    assert shard_units(rollouts) == [[0, 1, 2], [3, 4, 5], [6]]


def test_running_mean_on_rank_shares_gives_the_advantages_of_the_whole_step():
    cfg = AlgorithmConfig(name="running_mean", running_mean_window=3)
    steps = [[_rollout(f"s{s}r{i}", 2 + i, reward=float(10 * s + i)) for i in range(4)] for s in range(3)]
    whole = RunningMean(nn.Linear(1, 1), None, cfg)
    ranks = [RunningMean(nn.Linear(1, 1), None, cfg) for _ in range(2)]
    for rollouts in steps:
        expected = whole.row_advantages(collate(rollouts, 0))[0].tolist()
        got = {}
        for rank, rule in enumerate(ranks):
            batch = collate(shard_rollouts(rollouts, _ctx(rank, 2)), 0)
            batch.step_rewards = step_rewards(rollouts)  # as local_batch sets it
            got.update(zip(batch.interaction_ids, rule.row_advantages(batch)[0].tolist()))
            rule.window.extend(batch.step_rewards)  # what an applied step does
        whole.window.extend(collate(rollouts, 0).rewards.sum(dim=1).tolist())
        assert [got[r.interaction_id] for r in rollouts] == pytest.approx(expected, abs=1e-6)


def test_single_process_normalizer_and_metrics_are_local():
    batch = collate([_rollout("a", 3), _rollout("b", 5)], pad_token_id=0)
    assert global_token_normalizer(batch, _ctx(0, 1)) == 8.0
    empty = collate([Rollout("c", [1, 2], [False, False], [0.0, 0.0], [0, 0], {})], pad_token_id=0)
    assert global_token_normalizer(empty, _ctx(0, 1)) == 1.0
    assert reduce_metrics({"a": 1.5, "num_rollouts": 2.0}, _ctx(0, 1)) == {"a": 1.5, "num_rollouts": 2.0}


def test_decoder_layers_of_policy_and_critic():
    policy = fsdp_worker.tiny_policy(0)
    critic = ValueModel.from_policy(policy)
    assert [type(m).__name__ for m in decoder_layers(policy)] == ["Qwen2DecoderLayer"] * 2
    assert len(decoder_layers(critic)) == 2
    with pytest.raises(ValueError, match="no decoder layers"):
        decoder_layers(nn.Linear(2, 2))


def _run_two_ranks(out: Path, port: int, *options: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER), "--out", str(out), *options]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Output of the worker on two gloo ranks (run once for the module)."""
    out = tmp_path_factory.mktemp("two-ranks")
    _run_two_ranks(out, _free_port())
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """Output of the same worker in this process (world size 1)."""
    out = tmp_path_factory.mktemp("one-process")
    fsdp_worker.run_training(out)
    return out


def _assert_states_close(actual: dict, expected: dict, rtol: float, atol: float, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {name}: {m}")


def _load(directory: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(directory / f"{name}.safetensors")


def test_a_flag_set_on_one_rank_alone_is_seen_on_every_rank(two_ranks, one_process):
    """The learner's stop vote: a SIGTERM to rank 1 alone (its pod stopped by a node drain) stopped
    nothing, rank 0 deciding alone; rank 1 ran on until its SIGKILL, and rank 0 then failed in a
    collective without a checkpoint."""
    assert json.loads((two_ranks / "metrics.json").read_text())["stop_votes"] == [True, False]
    assert json.loads((one_process / "metrics.json").read_text())["stop_votes"] == [False, False]
    # the learner loop: rank 0 stops on rank 1's signal, before taking rollouts it would not train
    assert json.loads((two_ranks / "metrics.json").read_text())["loop_stop"] == {"stop": True, "took": False}
    assert json.loads((one_process / "metrics.json").read_text())["loop_stop"] == {"stop": False, "took": True}


def test_two_cpu_ranks_match_one_process(two_ranks, one_process):
    for model in ("policy", "critic", "reference"):
        _assert_states_close(_load(two_ranks, model), _load(one_process, model), WEIGHT_RTOL, WEIGHT_ATOL, model)
    initial = fsdp_worker.tiny_policy(fsdp_worker.MODEL_SEED).state_dict()
    trained = _load(one_process, "policy")
    assert all(not torch.equal(trained[k], initial[k]) for k in trained), "every policy tensor must have trained"

    optim_two, optim_one = _load(two_ranks, "policy_optim"), _load(one_process, "policy_optim")
    assert optim_two.keys() == optim_one.keys()
    for name, expected in optim_one.items():
        atol = STATE_RTOL * float(expected.abs().max())
        torch.testing.assert_close(optim_two[name], expected, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")

    # the critic's frozen attention stays at the policy's initial weights under FSDP too
    critic = _load(two_ranks, "critic")
    frozen = [k for k in critic if ".self_attn." in k]
    assert frozen and all(torch.equal(critic[k], initial[k.replace("backbone.", "model.", 1)]) for k in frozen)

    steps_two = json.loads((two_ranks / "metrics.json").read_text())["steps"]
    steps_one = json.loads((one_process / "metrics.json").read_text())["steps"]
    assert len(steps_two) == len(steps_one) == 3
    for got, want in zip(steps_two, steps_one):
        assert got["skipped_nonfinite"] == want["skipped_nonfinite"] == 0.0
        assert got["num_rollouts"] == want["num_rollouts"] and got["num_action_tokens"] == want["num_action_tokens"]
        assert got["reward_mean"] == pytest.approx(want["reward_mean"], rel=1e-6)
        assert got["version_lag_max"] == want["version_lag_max"]
        # per-rank losses divide by N_global / 2, so their mean over ranks is the global loss
        for key in ("policy_grad_norm", "critic_grad_norm", "policy_loss", "value_loss", "value_loss_after",
                    "kl_ref", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=STATE_RTOL), key


@pytest.mark.slow
def test_two_ranks_with_compiled_bodies_match_one_eager_process(tmp_path, one_process):
    """``trainer.compile`` under FSDP2: the bodies compiled after sharding train as the eager
    single process does, to the tolerances of the eager two ranks (measured: they hold)."""
    _run_two_ranks(tmp_path, _free_port(), "--compile")
    steps_two = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    steps_one = json.loads((one_process / "metrics.json").read_text())["steps"]
    assert json.loads((tmp_path / "metrics.json").read_text())["compiled"] == [True, True, True]
    assert json.loads((one_process / "metrics.json").read_text())["compiled"] == [False, False, False]
    assert len(steps_two) == len(steps_one) == 3
    for got, want in zip(steps_two, steps_one):
        assert got["skipped_nonfinite"] == want["skipped_nonfinite"] == 0.0
        for key in ("policy_grad_norm", "critic_grad_norm", "policy_loss", "value_loss", "kl_ref", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=STATE_RTOL), key
    for prefix in ("", "restored_"):  # trained, and restored into fresh compiled models then stepped
        for model in ("policy", "critic", "reference"):
            _assert_states_close(_load(tmp_path, prefix + model), _load(one_process, prefix + model),
                                 WEIGHT_RTOL, WEIGHT_ATOL, prefix + model)


def test_two_ranks_computing_in_bfloat16_keep_float32_weights_that_train(tmp_path, one_process):
    """``model.dtype: bfloat16`` under FSDP2: forward and backward in bfloat16, gradients reduced into
    float32 shards, so AdamW's steps are not rounded away: every tensor trains, to within bfloat16's
    rounding of the float32 process's update."""
    _run_two_ranks(tmp_path, _free_port(), "--compute-dtype", "bfloat16")
    initial = fsdp_worker.tiny_policy(fsdp_worker.MODEL_SEED).state_dict()
    trained, reference = _load(tmp_path, "policy"), _load(one_process, "policy")
    assert {t.dtype for t in trained.values()} == {torch.float32}
    assert all(not torch.equal(trained[k], initial[k]) for k in trained), "every policy tensor must have trained"
    # the update itself, not the weights it is small against; a lost update would be off by all of it
    update = torch.cat([(trained[k] - initial[k]).flatten() for k in trained])
    expected = torch.cat([(reference[k] - initial[k]).flatten() for k in trained])
    assert float((update - expected).norm()) <= BF16_UPDATE_RTOL * float(expected.norm())
    steps = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert all(s["skipped_nonfinite"] == 0.0 for s in steps)


def test_value_pretraining_under_two_ranks_matches_one_process(two_ranks, one_process):
    """Every rank fits on all logged rollouts (replicated work); per-rank shares are refused."""
    report_two = json.loads((two_ranks / "metrics.json").read_text())
    report_one = json.loads((one_process / "metrics.json").read_text())
    assert report_two["pretrain_refused_shares"] is True
    assert report_two["pretrain"]["epochs"] == report_one["pretrain"]["epochs"]
    assert report_two["pretrain"]["ev_after"] == pytest.approx(report_one["pretrain"]["ev_after"], rel=STATE_RTOL)
    assert report_one["pretrain"]["ev_after"] > report_one["pretrain"]["ev_before"]
    _assert_states_close(_load(two_ranks, "pretrained_critic"), _load(one_process, "pretrained_critic"),
                         WEIGHT_RTOL, WEIGHT_ATOL, "pretrained critic")


@pytest.mark.parametrize("rule", ["grpo", "running_mean"])
def test_baselines_under_two_ranks_give_the_advantages_of_one_process(two_ranks, one_process, rule):
    """grpo's groups and running_mean's window are the whole step's on every rank."""
    got = json.loads((two_ranks / "baselines.json").read_text())[rule]
    want = json.loads((one_process / "baselines.json").read_text())[rule]
    assert len(got) == len(want) == 3
    for step_got, step_want in zip(got, want):
        assert step_got == pytest.approx(step_want, abs=1e-6)
    assert any(abs(a) > 0.1 for step in want for a in step)  # advantages that could differ


def test_grpo_group_counts_under_two_ranks_are_the_whole_steps(two_ranks, one_process):
    """Each rank counts the groups of its share: the step's count is their sum, not their mean."""
    got = json.loads((two_ranks / "baselines.json").read_text())["grpo_metrics"]
    want = json.loads((one_process / "baselines.json").read_text())["grpo_metrics"]
    assert [m["num_groups"] for m in want] == [2.0, 2.0, 2.0]  # six rollouts of a step, groups of three
    assert [(m["num_groups"], m["singleton_groups"]) for m in got] == \
        [(m["num_groups"], m["singleton_groups"]) for m in want]


def test_whitened_advantages_under_two_ranks_match_one_process(two_ranks, one_process):
    """normalize_advantages whitens with the moments of the whole step's action tokens, not
    of each rank's share: loss and trained policy are the single process's."""
    steps_two = json.loads((two_ranks / "metrics.json").read_text())["whitened"]
    steps_one = json.loads((one_process / "metrics.json").read_text())["whitened"]
    assert len(steps_two) == len(steps_one) == fsdp_worker.WHITENED_STEPS
    for got, want in zip(steps_two, steps_one):
        assert got["skipped_nonfinite"] == want["skipped_nonfinite"] == 0.0
        for key in ("policy_loss", "policy_grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=STATE_RTOL), key
    _assert_states_close(_load(two_ranks, "whitened_policy"), _load(one_process, "whitened_policy"),
                         WEIGHT_RTOL, WEIGHT_ATOL, "whitened policy")


@pytest.mark.parametrize("world", ["one_process", "two_ranks"])
def test_gathered_state_round_trips_through_fresh_models(world, request):
    """Loading the gathered weights, optimisers and schedule into freshly built
    (differently initialised) models gives back the same weights, and the next step
    from there is bit-identical to the next step of the models that never stopped."""
    out = request.getfixturevalue(world)
    for model in ("policy", "critic", "reference"):
        _assert_states_close(_load(out, f"roundtrip_{model}"), _load(out, model), 0.0, 0.0, f"round trip {model}")
        continued = _load(out, f"continued_{model}")
        assert any(not torch.equal(v, _load(out, model)[k]) for k, v in continued.items()), "the extra step trained"
        _assert_states_close(_load(out, f"restored_{model}"), continued, 0.0, 0.0, f"restored {model}")


def test_a_drift_restart_under_two_ranks_returns_every_shard_to_its_start(two_ranks, one_process):
    """Trained two steps, then restarted on the sharded parameters: the policy is the initial one
    exactly, the critic its initial weights (as in one process), the optimisers' moments gone."""
    initial = fsdp_worker.tiny_policy(fsdp_worker.MODEL_SEED).state_dict()
    for out in (two_ranks, one_process):
        policy = _load(out, "restarted_policy")
        assert policy.keys() == initial.keys() and all(torch.equal(policy[k], initial[k]) for k in initial)
        assert json.loads((out / "metrics.json").read_text())["restart"]["optimizers_cleared"] is True
    critic_two, critic_one = _load(two_ranks, "restarted_critic"), _load(one_process, "restarted_critic")
    assert critic_two.keys() == critic_one.keys() and all(torch.equal(critic_two[k], v) for k, v in critic_one.items())


@pytest.mark.parametrize("saved, configured", [("foreach", "fused"), ("fused", "foreach")])
def test_a_restored_optimizer_keeps_its_configured_kernel_and_the_saved_moments(saved, configured):
    def optimizer(model: nn.Module, kernel: str) -> torch.optim.AdamW:
        return build_optimizers(AlgorithmConfig(optimizer_kernel=kernel, policy_lr=0.1), model, None).policy

    model = nn.Linear(2, 1, bias=False)
    first = optimizer(model, saved)
    model(torch.ones(1, 2)).sum().backward()
    first.step()
    model.zero_grad(set_to_none=True)  # as after a restart: no gradients yet
    restored = optimizer(model, configured)
    load_optimizer_state(model, restored, optimizer_state(model, first, _ctx(0, 1)), _ctx(0, 1))
    fresh = optimizer(nn.Linear(2, 1, bias=False), configured)
    assert [restored.param_groups[0][flag] for flag in KERNEL_FLAGS] == [fresh.param_groups[0][flag]
                                                                        for flag in KERNEL_FLAGS]
    assert restored.param_groups[0]["fused" if configured == "fused" else "foreach"] is True
    torch.testing.assert_close(restored.state[model.weight]["exp_avg"], first.state[model.weight]["exp_avg"])
    restored.step()  # the configured kernel runs on the restored state


def test_a_checkpoint_of_an_optimizer_without_state_leaves_it_and_its_restored_copy_without_state():
    """torch fills an empty optimiser state with a zero-gradient step when it is read or loaded:
    AdamW's counters would be 1, and the next real step, bias-corrected as a second one, would move
    each weight by about 0.74 lr instead of lr. Taken after a drift restart cleared it, a
    checkpoint must leave the next step what it would have been."""
    def optimizer(model: nn.Module) -> torch.optim.AdamW:
        return build_optimizers(AlgorithmConfig(policy_lr=0.1), model, None).policy

    def stepped(model: nn.Module, opt: torch.optim.AdamW) -> torch.Tensor:
        model(torch.ones(1, 2)).sum().backward()  # gradient 1 for each weight
        opt.step()
        model.zero_grad(set_to_none=True)
        return model.weight.detach().clone()

    ctx = _ctx(0, 1)
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    live = optimizer(model)
    saved = optimizer_state(model, live, ctx)
    assert live.state == {} and saved["state"] == {}
    restored_model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(restored_model.weight)
    restored = optimizer(restored_model)
    load_optimizer_state(restored_model, restored, saved, ctx)
    assert restored.state == {}
    # AdamW's first step moves each weight by lr = 0.1 against the gradient's sign (m/sqrt(v) = 1)
    expected = torch.full((1, 2), -0.1)
    torch.testing.assert_close(stepped(model, live), expected)
    torch.testing.assert_close(stepped(restored_model, restored), expected)


def test_a_ranks_share_reports_the_steps_mean_reward():
    """Shares are balanced by tokens, so their rollout counts differ: one long answer rewarded 1 on
    one rank, three short ones rewarded 0 on the other. The mean over ranks of the shares' means
    would be 0.5; the step's mean reward is 1/4."""
    from online_sao.train_step import batch_metrics

    step = [_rollout("long", 9, reward=1.0)] + [_rollout(f"short{i}", 3, reward=0.0) for i in range(3)]
    share = collate(step[:1], pad_token_id=0)
    share.step_rewards = step_rewards(step)
    assert batch_metrics(share, policy_packed=False)["reward_mean"] == 0.25
    assert batch_metrics(collate(step, pad_token_id=0), policy_packed=False)["reward_mean"] == 0.25
