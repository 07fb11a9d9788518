"""The SAO learner step on a random-weight model of the default architecture, under FSDP2.

Run it under ``torchrun --nproc_per_node N`` (N GPUs; the check uses one). The
process group is NCCL on CUDA and gloo on a CPU (the dry run). FSDP2 shards the
policy and the critic as the learner does (``fully_shard`` on each decoder layer,
then on the root, with float32 parameters and the forward and backward in ``--dtype``: FSDP2's
mixed precision), on one rank too, where ``trainer.distributed.shard_model``
would leave the model whole: the check is that FSDP2's gathers and
reduce-scatters run on NCCL and what they cost.

The step is the learner's: critic updates (K of them) and one policy update on a
batch of rollouts, each ``--prompt-tokens`` prompt tokens then ``--action-tokens``
action tokens with a reward on the last one (no padding: every rollout has the
same length). Floating-point work is counted once with torch's FlopCounterMode
(matrix products and attention, forward and backward) on the unsharded models,
which also warms them up, with attention run eagerly for the count: its two
matrix products are the model's FLOPs (the usual MFU convention: no
flash-attention recompute in the backward), and torch before 2.15 cannot count
SDPA with grouped-query heads, which transformers uses on CUDA; then the sharded models take
``--steps`` timed steps after one warm-up. MFU = counted FLOPs / median step
time / the GPU's dense bf16 peak (benchmarks/gpu/common.py).

The eager steps are then timed on ``--larger-batch`` times the rollouts too (does the MFU grow
with the batch?). One more eager step runs under torch's profiler (``common.profile_summary``): how much of
the step the GPU was busy, and the kernels that took its time; and one with the device synchronised
around each phase of the step (:func:`phase_split`): how the time divides between the critic's
updates, the policy's and the arithmetic. Both so that the report can say what limits the MFU.

With ``--compile`` the same sharded models are then compiled as ``trainer.compile`` does
(:func:`online_sao.modeling.compile_body`) and timed again after one compiling step; the eager
result is written first, so a section that runs out of time while compiling still reports it.

    torchrun --nproc_per_node 1 benchmarks/gpu/learner_step.py --out learner.json [--size half-b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedModel

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import (DTYPES, device, machine, peak_tflops, profile_summary, random_model,  # noqa: E402
                                   synchronize, write_result)
from online_sao.algorithms import build_algorithm, build_critic, build_optimizers  # noqa: E402
from online_sao.batch import Rollout, collate  # noqa: E402
from online_sao.config import AlgorithmConfig  # noqa: E402
from online_sao.modeling import compile_body  # noqa: E402
from online_sao.train_step import policy_logprobs  # noqa: E402
from trainer.distributed import DistContext, finite_vote, fully_shard_blocks, rank_sum  # noqa: E402


def join_group(where: torch.device) -> DistContext:
    """The torchrun group (NCCL on CUDA, gloo on CPU), joined even with one rank."""
    if where.type == "cuda":
        dist.init_process_group("nccl", device_id=where)
    else:
        dist.init_process_group("gloo")
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=where)


def make_batch(policy, args, vocab: int, where: torch.device):
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    length = args.prompt_tokens + args.action_tokens
    mask = [False] * args.prompt_tokens + [True] * args.action_tokens
    rollouts = [Rollout(f"r{i}", torch.randint(3, vocab, (length,), generator=gen).tolist(), mask,
                        [0.0] * length, [0] * length, {length - 1: float(torch.rand((), generator=gen))})
                for i in range(args.rollouts)]
    batch = collate(rollouts, pad_token_id=0, policy_version=1).to(where)
    with torch.no_grad():  # behaviour log-probs: the policy's own, so importance ratios start at 1
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


def build(policy, critic, ctx: DistContext, cfg: AlgorithmConfig):
    opts = build_optimizers(cfg, policy, critic)
    return build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler,
                           vote=finite_vote(ctx), sum_over_ranks=rank_sum(ctx))


@contextmanager
def eager_attention(*models: torch.nn.Module) -> Iterator[None]:
    """Every transformers model inside ``models`` runs eager attention, then what it ran before."""
    found = [m for model in models for m in model.modules() if isinstance(m, PreTrainedModel)]
    before = [m.config._attn_implementation for m in found]
    for m in found:
        m.set_attn_implementation("eager")
    try:
        yield
    finally:
        for m, implementation in zip(found, before):
            m.set_attn_implementation(implementation)


def run(args) -> dict:
    where = device()
    ctx = join_group(where)
    cfg = AlgorithmConfig()
    torch.manual_seed(0)
    policy = random_model(args.size, "float32", where)  # the learner's weights; it computes in args.dtype
    # as the learner builds it (SAO's frozen-attention copy), then moved as trainer.distributed.shard_model moves it:
    # its new value head is made on the CPU
    critic = build_critic(cfg, policy).to(where)
    params = sum(p.numel() for p in policy.parameters())
    batch = make_batch(policy, args, policy.config.vocab_size, where)

    algorithm = build(policy, critic, ctx, cfg)
    with eager_attention(policy, critic), FlopCounterMode(display=False) as counter:
        algorithm.step(batch)
    flops = counter.get_total_flops()
    del algorithm  # its optimiser state held the unsharded parameters
    fully_shard_blocks(policy, DTYPES[args.dtype])
    fully_shard_blocks(critic, DTYPES[args.dtype])
    algorithm = build(policy, critic, ctx, cfg)
    algorithm.step(batch)  # warm-up of the sharded models: first all-gathers, optimiser state
    synchronize(where)
    if where.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where)
    times, metrics = timed_steps(algorithm, batch, args.steps, where)
    step_s = statistics.median(times)
    tokens = batch.input_ids.numel() * ctx.world_size
    peak = peak_tflops(where)
    achieved = flops * ctx.world_size / step_s / 1e12
    result = {
        "machine": machine(where), "backend": dist.get_backend(), "world_size": ctx.world_size,
        "size": args.size, "dtype": args.dtype, "parameters": params,
        "rollouts_per_rank": args.rollouts, "prompt_tokens": args.prompt_tokens, "action_tokens": args.action_tokens,
        "critic_updates": cfg.critic_updates, "steps": args.steps, "step_s": times, "step_s_median": step_s,
        "tokens_per_s": tokens / step_s, "action_tokens_per_s": float(batch.action_mask.sum()) * ctx.world_size
        / step_s, "flops_per_step": flops * ctx.world_size, "achieved_tflops": achieved,
        "peak_tflops": peak, "mfu": achieved / peak if peak else None,
        "skipped_nonfinite": metrics.get("skipped_nonfinite", 0.0),
        "max_memory_gib": torch.cuda.max_memory_allocated(where) / 2**30 if where.type == "cuda" else None,
        "profile": profile_summary(lambda: algorithm.step(batch), where, units=1),  # one more eager step
        "phases": phase_split(algorithm, batch, where),
    }
    if args.larger_batch > 1:
        result["larger_batch"] = larger_batch(algorithm, policy, args, where, flops * ctx.world_size, peak)
    if args.compile:
        if ctx.is_main:  # what is known so far, should the section's time run out while compiling
            write_result(args.out, "learner_step", lambda: {**result, "compiled": {"error": "did not finish"}})
        result["compiled"] = compiled_steps(policy, critic, algorithm, batch, args.steps, where,
                                            flops * ctx.world_size, peak)
    dist.destroy_process_group()
    return result


def timed_steps(algorithm, batch, steps: int, where: torch.device) -> tuple[list[float], dict[str, float]]:
    """Seconds of each of ``steps`` learner steps on ``batch``, and the last step's metrics."""
    times, metrics = [], {}
    for _ in range(steps):
        start = time.perf_counter()
        metrics = algorithm.step(batch)
        synchronize(where)
        times.append(time.perf_counter() - start)
    return times, metrics


def phase_split(algorithm, batch, where: torch.device) -> dict:
    """One more eager step with the device synchronised around each of its phases (``SAO.phase_sync``):
    the seconds of each phase (critic forward, backward, optimizer; the same for the policy; the
    arithmetic between them) and of the whole step, which the waits make a little longer than an
    unsynchronised one. Where a step's time goes, phase by phase."""
    algorithm.phase_sync = lambda: synchronize(where)
    try:
        start = time.perf_counter()
        metrics = algorithm.step(batch)
        synchronize(where)
        total = time.perf_counter() - start
    finally:
        algorithm.phase_sync = None
    phases = {k[len("time_"):-len("_s")]: v for k, v in metrics.items() if k.startswith("time_") and k.endswith("_s")}
    return {"step_s": total, "phases_s": phases}


def larger_batch(algorithm, policy, args, where: torch.device, flops: float, peak: float | None) -> dict:
    """The same eager steps on ``--larger-batch`` times the rollouts. An MFU that grows with the batch
    says the step was bound by per-kernel costs (launches, small kernels); one that stays says the
    kernels themselves are slow. FLOPs grow with the rollouts at a fixed length. Running out of GPU
    memory is reported, not raised: the numbers at the first size stand."""
    wider = argparse.Namespace(**{**vars(args), "rollouts": args.rollouts * args.larger_batch})
    try:
        batch = make_batch(policy, wider, policy.config.vocab_size, where)
        algorithm.step(batch)  # warm-up at this shape
        synchronize(where)
        times, _ = timed_steps(algorithm, batch, args.steps, where)
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"rollouts_per_rank": wider.rollouts, "error": f"out of GPU memory: {str(exc)[:200]}"}
    step_s = statistics.median(times)
    achieved = flops * args.larger_batch / step_s / 1e12
    return {"rollouts_per_rank": wider.rollouts, "step_s": times, "step_s_median": step_s,
            "tokens_per_s": batch.input_ids.numel() * dist.get_world_size() / step_s, "achieved_tflops": achieved,
            "mfu": achieved / peak if peak else None,
            "max_memory_gib": torch.cuda.max_memory_allocated(where) / 2**30 if where.type == "cuda" else None}


def compiled_steps(policy, critic, algorithm, batch, steps: int, where: torch.device, flops: float,
                   peak: float | None) -> dict:
    """The bodies compiled in place (``trainer.compile``), one compiling step, then ``steps`` timed ones.
    A failure to compile is reported, not raised: the eager numbers stand."""
    try:
        compile_body(policy)
        compile_body(critic)
        start = time.perf_counter()
        algorithm.step(batch)
        synchronize(where)
        compile_s = time.perf_counter() - start
        times, _ = timed_steps(algorithm, batch, steps, where)
    except Exception as exc:  # torch.compile's own errors: say which, keep the eager result
        return {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    step_s = statistics.median(times)
    achieved = flops / step_s / 1e12
    return {"compile_s": compile_s, "step_s": times, "step_s_median": step_s,
            "tokens_per_s": batch.input_ids.numel() * dist.get_world_size() / step_s, "achieved_tflops": achieved,
            "mfu": achieved / peak if peak else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=["half-b", "tiny"], default="half-b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rollouts", type=int, default=32, help="per rank")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--action-tokens", type=int, default=384)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    parser.add_argument("--larger-batch", type=int, default=2,
                        help="then time the eager steps on this many times the rollouts (1: do not)")
    parser.add_argument("--compile", action="store_true",
                        help="then compile the bodies (trainer.compile) and time the same steps again")
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        run(args)
        return 0
    return write_result(args.out, "learner_step", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
