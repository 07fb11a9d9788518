"""Worker of the FSDP equivalence test (tests/trainer/test_distributed.py).

Run under ``torchrun --nproc_per_node 2`` it trains on two gloo ranks; called in
a plain process (or via :func:`run_training`) it is the single-process
reference. Either way it trains a tiny Qwen2 policy and its critic with SAO for
a few steps on fixed rollouts, then checks the state round trip a learner
checkpoint relies on, and writes on rank 0, as safetensors under ``--out``:

- ``policy.safetensors``, ``critic.safetensors``, ``reference.safetensors``: weights after
  training (SAO with the KL penalty to an EMA reference and the entropy bonus on, so their
  sharded paths run too);
- ``policy_optim.safetensors``: the policy's full AdamW state;
- ``roundtrip_policy.safetensors``, ``roundtrip_critic.safetensors``: those
  weights loaded into freshly built (differently initialised) sharded models
  with :func:`load_full_state_dict` and gathered again;
- ``continued_*`` / ``restored_*``: one more step taken by the trained models
  and by the restored ones (weights, both optimisers, the critic schedule);
- ``pretrained_critic.safetensors``: the restored critic after value pre-training
  on all the rollouts (every rank passing all of them, as the learner must);
- ``metrics.json``: the step metrics reduced over ranks, whether the trained learner's policy,
  critic and reference bodies are compiled (``--compile``), the pre-training metrics,
  and whether pre-training refused per-rank shares (it must, in two ranks);
- ``baselines.json``: for ``grpo`` and ``running_mean``, the advantage each rank's rule
  gave every rollout of each step (grouped rollouts, gathered in the step's order), and under
  ``<rule>_metrics`` each step's metrics reduced over ranks;
- ``whitened_policy.safetensors`` and ``whitened`` in ``metrics.json``: the policy and the
  step metrics of SAO with ``normalize_advantages`` on, trained from fresh models;
- ``restarted_policy.safetensors``, ``restarted_critic.safetensors`` and ``restart`` in
  ``metrics.json``: fresh models trained two steps, then restarted by the drift response
  (trainer/plasticity.py) on the sharded parameters; whether the optimisers' state was cleared.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig, DriftConfig
from online_sao.critic import ValueModel
from online_sao.modeling import compile_body, is_compiled
from online_sao.regularizers import build_reference
from online_sao.train_step import policy_logprobs
from trainer.distributed import (
    DistContext,
    any_rank,
    broadcast_rollouts,
    finite_vote,
    init_distributed,
    local_batch,
    rank_sum,
    reduce_metrics,
    shard_model,
    shard_rollouts,
    shutdown_distributed,
)
from trainer.full_state import full_state_dict, load_full_state_dict, load_optimizer_state, optimizer_state
from trainer.plasticity import DriftResponse
from trainer.pretrain import pretrain_critic
from trainer.state import Trainables


VOCAB = 64
PAD_ID = 0
ROLLOUTS_PER_STEP = 6
MODEL_SEED = 0
REGULARIZED = {"kl_beta": 0.1, "kl_reference": "ema", "kl_ema_rate": 0.5, "entropy_alpha": 0.01,
               "critic_after_metrics": True}
"""The section-3b terms, on: the reference is sharded, run and moved like the policy; and the critic's
values after its updates, so the updated critic's loss is compared across ranks too."""


def tiny_policy(seed: int) -> Qwen2ForCausalLM:
    """Same sizes and tied embeddings as the project's default model, much smaller."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=PAD_ID)
    return Qwen2ForCausalLM(config)


def _trajectory(rng: random.Random) -> tuple[list[int], list[bool], dict[int, float]]:
    """Prompt, one or two action segments with an observation between, rewards from the tokens."""
    tokens = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
    mask = [False] * len(tokens)
    rewards: dict[int, float] = {}
    for segment in range(rng.randint(1, 2)):
        if segment:
            observation = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3))]
            tokens += observation
            mask += [False] * len(observation)
            rewards[len(tokens) - 1] = 0.25  # reward given during the observation
        actions = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 7))]
        tokens += actions
        mask += [True] * len(actions)
    evens = sum(1 for t, m in zip(tokens, mask) if m and t % 2 == 0)
    rewards[len(tokens) - 1] = rewards.get(len(tokens) - 1, 0.0) + evens / sum(mask) - 0.5
    return tokens, mask, rewards


def make_rollouts(policy: torch.nn.Module, steps: int, seed: int) -> list[list[Rollout]]:
    """Rollouts of each step; behaviour log-probs are the initial policy's, offset so
    most tokens sit inside the DIS band and a few fall below or above it."""
    rng = random.Random(seed)
    per_step = []
    for step in range(steps):
        drafts = [_trajectory(rng) for _ in range(ROLLOUTS_PER_STEP)]
        placeholder = [Rollout(f"s{step}-{i}", t, m, [0.0] * len(t), [0] * len(t), r)
                       for i, (t, m, r) in enumerate(drafts)]
        with torch.no_grad():
            logp = policy_logprobs(policy, collate(placeholder, PAD_ID))
        rollouts = []
        for i, (tokens, mask, rewards) in enumerate(drafts):
            offsets = [rng.uniform(-0.2, 0.2) for _ in tokens]
            actions = [t for t, m in enumerate(mask) if m]
            offsets[actions[0]] = 2.0 if i % 2 else -2.5  # ratio e^-2 (masked below) or e^2.5 (above)
            logprobs = [float(logp[i, t]) + offsets[t] if m else 0.0 for t, m in enumerate(mask)]
            rollouts.append(Rollout(f"s{step}-{i}", tokens, mask, logprobs, [0] * len(tokens), rewards))
        per_step.append(rollouts)
    return per_step


class Learner:
    """Policy, critic, EMA reference, optimisers and SAO, sharded for ``ctx`` (their bodies
    compiled after sharding with ``compile``, as the learner does with ``trainer.compile``)."""

    def __init__(self, cfg: AlgorithmConfig, ctx: DistContext, seed: int, compile: bool = False,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        self.ctx = ctx
        self.policy = tiny_policy(seed)
        self.critic = ValueModel.from_policy(self.policy, freeze_attention=cfg.freeze_critic_attention)
        self.reference = build_reference(cfg, self.policy)
        for model in (self.policy, self.critic, self.reference):
            if model is not None:  # no reference without the KL penalty (the baselines' runs)
                shard_model(model, ctx, compute_dtype)
                if compile:
                    compile_body(model)
        self.optimizers = build_optimizers(cfg, self.policy, self.critic)
        self.algorithm = build_algorithm(cfg, self.policy, self.critic, self.optimizers.policy,
                                         self.optimizers.critic, self.optimizers.critic_scheduler,
                                         vote=finite_vote(ctx), reference=self.reference,
                                         sum_over_ranks=rank_sum(ctx))  # as the learner builds it

    def step(self, rollouts: list[Rollout], version: int) -> dict[str, float]:
        batch = local_batch(rollouts, self.ctx, PAD_ID, version).to(self.ctx.device)  # as the learner does
        return reduce_metrics(self.algorithm.step(batch), self.ctx)

    def advantages_then_step(self, rollouts: list[Rollout], version: int) -> list[float]:
        """The advantage this rank's rule gives each rollout of the step (0 for the other ranks'
        rollouts, summed over ranks: every rollout is on exactly one), then the step itself."""
        batch = local_batch(rollouts, self.ctx, PAD_ID, version).to(self.ctx.device)
        row_advantages = self.algorithm.row_advantages(batch)[0]
        position = {r.interaction_id: i for i, r in enumerate(rollouts)}
        gathered = torch.zeros(len(rollouts), dtype=torch.float64)
        for iid, value in zip(batch.interaction_ids, row_advantages.tolist()):
            gathered[position[iid]] = value
        if self.ctx.is_distributed:
            dist.all_reduce(gathered, op=dist.ReduceOp.SUM)
        self.last_metrics = reduce_metrics(self.algorithm.step(batch), self.ctx)
        return gathered.tolist()

    def gather(self) -> dict[str, dict]:
        opts = self.optimizers
        return {
            "policy": full_state_dict(self.policy, self.ctx),
            "critic": full_state_dict(self.critic, self.ctx),
            "reference": full_state_dict(self.reference, self.ctx),
            "policy_optim": optimizer_state(self.policy, opts.policy, self.ctx),
            "critic_optim": optimizer_state(self.critic, opts.critic, self.ctx),
            "critic_schedule": opts.critic_scheduler.state_dict(),
        }

    def restore(self, state: dict[str, dict]) -> None:
        opts, main = self.optimizers, self.ctx.is_main
        load_full_state_dict(self.policy, state["policy"] if main else None, self.ctx)
        load_full_state_dict(self.critic, state["critic"] if main else None, self.ctx)
        load_full_state_dict(self.reference, state["reference"] if main else None, self.ctx)
        load_optimizer_state(self.policy, opts.policy, state["policy_optim"] if main else None, self.ctx)
        load_optimizer_state(self.critic, opts.critic, state["critic_optim"] if main else None, self.ctx)
        opts.critic_scheduler.load_state_dict(state["critic_schedule"])


def flat_optimizer_state(state: dict) -> dict[str, torch.Tensor]:
    """Tensors of a full optimiser state dict under ``<param>.<slot>`` names."""
    return {f"{name}.{slot}": torch.as_tensor(value).clone() for name, slots in state["state"].items()
            for slot, value in slots.items()}


GROUP_SIZE = 3
"""grpo groups of the baseline steps: the six rollouts of a step form two groups."""


def baseline_advantages(ctx: DistContext, data: list[list[Rollout]] | None, steps: int) -> dict[str, list]:
    """Per step, the advantages grpo and running_mean give the step's rollouts (grouped as the
    join groups them: consecutive members, group ids by order)."""
    report = {}
    for name in ("grpo", "running_mean"):
        learner = Learner(AlgorithmConfig(name=name, group_size=GROUP_SIZE, running_mean_window=8), ctx, MODEL_SEED)
        per_step, step_metrics = [], []
        for step in range(steps):
            grouped = None if data is None else [replace(r, group_id=i // GROUP_SIZE)
                                                 for i, r in enumerate(data[step])]
            per_step.append(learner.advantages_then_step(broadcast_rollouts(grouped, ctx), version=step))
            step_metrics.append(learner.last_metrics)
        report[name] = per_step
        report[f"{name}_metrics"] = step_metrics
    return report


WHITENED_STEPS = 2


def whitened_training(ctx: DistContext, data: list[list[Rollout]] | None) -> tuple[dict | None, list[dict]]:
    """SAO with whitened advantages for WHITENED_STEPS steps from fresh models: the gathered
    policy (rank 0; None elsewhere) and the reduced step metrics."""
    learner = Learner(AlgorithmConfig(normalize_advantages=True), ctx, MODEL_SEED)
    metrics = [learner.step(broadcast_rollouts(data[step] if data is not None else None, ctx), version=step)
               for step in range(WHITENED_STEPS)]
    return full_state_dict(learner.policy, ctx), metrics


RESTART_STEPS = 2


def restarted_training(ctx: DistContext, data: list[list[Rollout]] | None) -> tuple[dict, bool]:
    """Fresh models trained RESTART_STEPS steps, then restarted: their gathered weights (rank 0)
    and whether both optimisers' state is empty on this rank."""
    learner = Learner(AlgorithmConfig(), ctx, MODEL_SEED)
    trainables = Trainables(learner.policy, learner.critic, learner.optimizers, learner.algorithm)
    response = DriftResponse(DriftConfig(enabled=True), trainables)  # remembers the starting shards
    for step in range(RESTART_STEPS):
        learner.step(broadcast_rollouts(data[step] if data is not None else None, ctx), version=step)
    response.restart()
    cleared = not learner.optimizers.policy.state and not learner.optimizers.critic.state
    return {"policy": full_state_dict(learner.policy, ctx), "critic": full_state_dict(learner.critic, ctx)}, cleared


def run_training(out: Path, steps: int = 3, seed: int = 1, compile: bool = False,
                 compute_dtype: torch.dtype = torch.float32) -> None:
    """Everything the module docstring lists; with ``compile`` the trained and the restored
    learners' bodies are compiled (the baselines', whitened and restarted runs stay eager); with a
    ``compute_dtype`` the trained and restored learners compute in it (FSDP2 mixed precision)."""
    ctx = init_distributed()
    torch.manual_seed(seed)  # identical on every rank and in the single-process reference
    cfg = AlgorithmConfig(**REGULARIZED)
    learner = Learner(cfg, ctx, MODEL_SEED, compile, compute_dtype)
    # Rank 0 makes the data (as it reads the stream) with its still-unsharded copy of
    # the initial policy; the other ranks receive it through broadcast_rollouts.
    data = make_rollouts(tiny_policy(MODEL_SEED), steps + 1, seed) if ctx.is_main else None
    metrics = []
    for step in range(steps + 1):
        rollouts = broadcast_rollouts(data[step] if ctx.is_main else None, ctx)
        if step == steps:
            final = rollouts
            break
        metrics.append(learner.step(rollouts, version=step))

    trained = learner.gather()
    fresh = Learner(cfg, ctx, MODEL_SEED + 1, compile, compute_dtype)
    fresh.restore(trained)
    roundtrip = fresh.gather()
    learner.step(final, version=steps)
    fresh.step(final, version=steps)
    continued, restored = learner.gather(), fresh.gather()

    # value pre-training as the learner runs it: the same rollouts on every rank
    logged = broadcast_rollouts([r for step in data for r in step] if ctx.is_main else None, ctx)
    refused_shares = None
    if ctx.is_distributed:
        try:
            pretrain_critic(fresh.critic, fresh.optimizers.critic, shard_rollouts(logged, ctx), cfg, PAD_ID)
            refused_shares = False
        except ValueError:
            refused_shares = True
    pretrain = pretrain_critic(fresh.critic, fresh.optimizers.critic, logged, cfg, PAD_ID, max_epochs=3, patience=1)
    pretrained = full_state_dict(fresh.critic, ctx)
    baselines = baseline_advantages(ctx, data if ctx.is_main else None, steps)
    whitened_policy, whitened = whitened_training(ctx, data if ctx.is_main else None)
    restarted, cleared = restarted_training(ctx, data if ctx.is_main else None)
    stop_votes = [any_rank(ctx.rank == 1, ctx), any_rank(False, ctx)]  # rank 1's flag alone, then none
    loop_stop = loop_stop_vote(ctx)

    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file(trained["policy"], out / "policy.safetensors")
        save_file(trained["critic"], out / "critic.safetensors")
        save_file(trained["reference"], out / "reference.safetensors")
        save_file(flat_optimizer_state(trained["policy_optim"]), out / "policy_optim.safetensors")
        for prefix, state in (("roundtrip", roundtrip), ("continued", continued), ("restored", restored)):
            for model in ("policy", "critic", "reference"):
                save_file(state[model], out / f"{prefix}_{model}.safetensors")
        save_file(pretrained, out / "pretrained_critic.safetensors")
        save_file(whitened_policy, out / "whitened_policy.safetensors")
        save_file(restarted["policy"], out / "restarted_policy.safetensors")
        save_file(restarted["critic"], out / "restarted_critic.safetensors")
        compiled = [is_compiled(model) for model in (learner.policy, learner.critic, learner.reference)]
        report = {"steps": metrics, "compiled": compiled, "pretrain": pretrain, "pretrain_refused_shares": refused_shares,
                  "whitened": whitened, "restart": {"optimizers_cleared": cleared},
                  "stop_votes": stop_votes, "loop_stop": loop_stop}
        (out / "metrics.json").write_text(json.dumps(report))
        (out / "baselines.json").write_text(json.dumps(baselines))
    shutdown_distributed(ctx)


def loop_stop_vote(ctx: DistContext) -> dict[str, bool]:
    """The learner loop's decision (trainer.learner.next_rollouts) with a stop signal to rank 1 alone
    (none in one process), rank 0's feed stood in for: whether it stopped, and whether rank 0 took
    rollouts it would then not train."""
    from types import SimpleNamespace

    from trainer.learner import RunUntil, next_rollouts

    until, took = RunUntil(), []
    if ctx.rank == 1:
        until.stop.set()
    feed = SimpleNamespace(poll=lambda: None, drop_stale=lambda version: None, idle_s=lambda: 0.0,
                           take=lambda ranks, hook: took.append(ranks))
    rank0 = SimpleNamespace(feed=feed, renew_metrics=lambda at: None) if ctx.is_main else None
    taken = next_rollouts(rank0, SimpleNamespace(steps_here=0, version=0), until, ctx, None)
    return {"stop": taken.stop, "took": bool(took)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compile the learners' bodies (trainer.compile)")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the dtype the sharded learners compute in (model.dtype)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share two cores
    run_training(args.out, args.steps, compile=args.compile, compute_dtype=getattr(torch, args.compute_dtype))


if __name__ == "__main__":
    main()
