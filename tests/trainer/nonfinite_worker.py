"""Worker of tests/trainer/test_nonfinite_two_ranks.py, run under ``torchrun --nproc_per_node 2``.

Both ranks build the same tiny policy and critic, shard them with FSDP2 and take
SAO steps with the learner's :func:`trainer.distributed.finite_vote`. In the first
step only rank 1's share is poisoned (a finite reward whose squared error
overflows float32); both ranks must refuse it and keep their weights, then train
on the next, finite step together. Rank 0 writes ``result.json`` under ``--out``:
each step's metrics as every rank saw them (gathered) and whether the gathered
weights were unchanged after the refused step and changed after the next one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from trainer.distributed import finite_vote, global_token_normalizer, init_distributed, shard_model, shutdown_distributed
from trainer.full_state import full_state_dict
from tests.trainer.fsdp_worker import PAD_ID, tiny_policy

OVERFLOW_REWARD = 1e38
"""Finite, but (V - 1e38)^2 is inf in float32."""


def _share(rank: int, reward: float) -> list[Rollout]:
    """This rank's two rollouts (prompt of 3, 4 action tokens); the first gets ``reward``."""
    out = []
    for i, r in enumerate([reward, -0.5]):
        ids = [1, 2, 3] + [10 + 4 * rank + i + j for j in range(4)]
        mask = [False] * 3 + [True] * 4
        out.append(Rollout(f"r{rank}-{i}", ids, mask, [-1.0 if m else 0.0 for m in mask], [0] * 7, {6: r}))
    return out


def _gathered(model, ctx) -> dict[str, torch.Tensor]:
    return full_state_dict(model, ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    torch.set_num_threads(1)
    ctx = init_distributed()
    cfg = AlgorithmConfig(policy_lr=1e-3, critic_lr=5e-3, critic_warmup_steps=0)
    policy = tiny_policy(0)
    critic = ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention)
    shard_model(policy, ctx)
    shard_model(critic, ctx)
    opts = build_optimizers(cfg, policy, critic)
    algo = build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler,
                           vote=finite_vote(ctx))
    start = {"policy": _gathered(policy, ctx), "critic": _gathered(critic, ctx)}

    steps, weights_after = [], []
    for poison in (OVERFLOW_REWARD if ctx.rank == 1 else 1.0, 1.0):
        batch = collate(_share(ctx.rank, poison), PAD_ID)
        batch.token_normalizer = global_token_normalizer(batch, ctx)
        metrics = algo.step(batch)
        seen: list = [None] * ctx.world_size
        dist.all_gather_object(seen, {"skipped_nonfinite": metrics["skipped_nonfinite"], "keys": sorted(metrics)})
        steps.append(seen)
        weights_after.append({"policy": _gathered(policy, ctx), "critic": _gathered(critic, ctx)})

    if ctx.is_main:
        def same(a, b):
            return all(torch.equal(a[m][k], b[m][k]) for m in a for k in a[m])
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({
            "steps": steps,
            "unchanged_after_refused": same(start, weights_after[0]),
            "changed_after_next": not same(weights_after[0], weights_after[1]),
        }))
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main()
