"""Data-parallel training across ranks: FSDP2 sharding, full state dicts, rollout
distribution, the global token normaliser and metric reduction.

One process (``python -m ...``) runs with world size 1: every function here is
then the identity or a local operation and no process group exists. Under
``torchrun`` each rank joins one process group (NCCL on CUDA, gloo on CPU);
policy and critic are sharded with FSDP2 (``fully_shard``) per decoder layer
plus the root, so each rank holds 1/world_size of the parameters, gradients
and optimiser state.

Equivalence with one process (tested in tests/trainer/test_distributed.py):
rank 0 reads the step's rollouts and broadcasts them, every rank takes a
deterministic share (:func:`shard_rollouts`) that keeps every grpo group whole,
so group statistics are the single process's, and each rank's batch carries
the whole step's rewards (:func:`local_batch`), so running_mean keeps one
window on every rank. Each rank's token-mean loss divides by
``N_global / world_size`` (:func:`global_token_normalizer`). FSDP averages
gradients over ranks in its reduce-scatter, so the averaged gradient is
``sum over all tokens / N_global``: the single-process token mean. Whitened
advantages use the moments of every rank's action tokens (:func:`rank_sum`).

Full state dicts (for publishing weights and checkpoints) are in
:mod:`trainer.full_state`.
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import os
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Collection, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from online_sao.advantages import SumOverRanks, local_sum
from online_sao.batch import Rollout, RolloutBatch, collate, rollouts_from_json, rollouts_to_json, step_rewards
from online_sao.train_step import FiniteVote, local_vote

MIN_TOKEN_NORMALIZER = 1.0
"""Floor of the global action-token count: a step without action tokens gives
loss 0 instead of 0/0 (same floor as online_sao.losses.MIN_NORMALIZER)."""

T = TypeVar("T")

SUMMED_METRICS = frozenset({"num_rollouts", "num_action_tokens", "num_groups", "singleton_groups"})
"""Metrics that count things on each rank's share: the step's value is the sum
over ranks, not the mean (a GRPO group is never split across ranks)."""
MAXED_METRICS = frozenset({"version_lag_max"})
"""Metrics that are a maximum over each rank's share: the step's value is the maximum over ranks."""

@dataclass(frozen=True)
class DistContext:
    """Where this process sits among the learner's ranks."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that reads streams, publishes, checkpoints and logs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float | None = None) -> DistContext:
    """Join the process group torchrun describes, or run alone.

    torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``. With more than one
    rank the group uses NCCL when CUDA is available (one GPU per local rank) and
    gloo otherwise. A plain process, or torchrun with one rank, gets world size 1
    and no process group. ``timeout_s``: how long a collective waits for the other
    ranks (``trainer.collective_timeout_s``; None: torch's default).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return DistContext(rank=rank, world_size=world_size, device=device)


def run_on_ranks(work: Callable[[DistContext], T], timeout_s: float | None = None) -> T:
    """Join the process group (:func:`init_distributed`), run ``work`` and leave it
    (:func:`shutdown_distributed`). A rank whose ``work`` raises leaves without the closing
    barrier: its peers sit in a collective of the step it left, so both would wait there until
    the collective timeout (30 minutes on gloo) with the error unprinted. Its exit closes its
    connections, the peers' collective fails at once and torchrun ends the job."""
    ctx = init_distributed(timeout_s)
    result = work(ctx)
    shutdown_distributed(ctx)
    return result


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave the process group (no-op in a single process)."""
    if ctx.is_distributed and dist.is_initialized():
        # unreachable sharded state (and the collective work it may hold) is freed while the
        # group is up, not during interpreter teardown; then every rank finishes its collectives
        # before any tears its transport down: a rank that leaves first can abort a peer still
        # inside gloo ("terminate called without an active exception")
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model (or a module wrapping one).

    Blocks are the modules whose class a ``PreTrainedModel`` inside ``model``
    names in ``_no_split_modules`` (e.g. ``Qwen2DecoderLayer``); that is the
    unit transformers itself never splits across devices.
    """
    block_classes: set[str] = set()
    for module in model.modules():
        block_classes.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in block_classes]
    if not layers:
        raise ValueError(f"no decoder layers found in {type(model).__name__} "
                         f"(looked for classes named in _no_split_modules: {sorted(block_classes)})")
    return layers


def shard_model(model: nn.Module, ctx: DistContext, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """FSDP2 ``fully_shard`` on each decoder layer, then on the root.

    Moves the model to ``ctx.device`` first. Returns the same module (FSDP2 shards
    in place). World size 1: only the move. Call before building optimisers: the
    optimiser must hold the sharded parameters. ``compute_dtype`` other than the parameters'
    (float32): FSDP2's mixed precision gathers the parameters in it for the forward and backward
    and reduces the gradients in float32 into the float32 shards, so the optimiser's steps stay
    exact (one process computes in the parameters' dtype).
    """
    model.to(ctx.device)
    if ctx.is_distributed:
        fully_shard_blocks(model, compute_dtype)
    return model


def fully_shard_blocks(model: nn.Module, compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 ``fully_shard`` on each decoder layer, then on the root, in the process group that is
    joined; mixed precision (``compute_dtype`` for the forward and backward, float32 gradient
    reduction) when ``compute_dtype`` is not float32."""
    precision = {} if compute_dtype == torch.float32 else {
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)}
    for layer in decoder_layers(model):
        fully_shard(layer, **precision)
    fully_shard(model, **precision)


def sharded_parameters(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shards of ``model``'s parameters, in ``parameters()`` order (all of them in one
    process). Every FSDP2 module is resharded first: after a forward without a backward (a
    ``no_grad`` pass) it keeps its unsharded plain tensors registered in place of its DTensor shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return list(model.parameters())


def finite_vote(ctx: DistContext) -> FiniteVote:
    """The learning rules' finiteness vote across ranks: the minimum of every rank's
    flag (all-reduce), so a non-finite loss or gradient on one rank's share makes
    every rank refuse the same update. Collective: every rank calls it at the same
    check. One process gets its own result back."""
    if not ctx.is_distributed:
        return local_vote

    def vote(finite: bool) -> bool:
        flag = torch.tensor([1 if finite else 0], dtype=torch.int32, device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return vote


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """Whether ``flag`` is set on any rank (a maximum all-reduce). Collective. One process gets its
    own flag back."""
    if not ctx.is_distributed:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def rank_sum(ctx: DistContext) -> SumOverRanks:
    """The learning rules' sum over ranks (whitening's moments of the whole step): a float64
    all-reduce on ``ctx.device``. Collective: every rank calls it at the same point. One
    process gets its own values back."""
    if not ctx.is_distributed:
        return local_sum

    def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
        total = values.to(device=ctx.device, dtype=torch.float64, copy=True)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(values.device)

    return sum_over_ranks


def broadcast_json(value: Any, ctx: DistContext) -> Any:
    """Rank 0's JSON-serialisable ``value`` on every rank (others pass anything). Collective.

    Sent as a length, then a byte tensor of JSON: nothing is unpickled. Python floats
    round-trip exactly through JSON, so logprobs arrive bit-identical.
    """
    if not ctx.is_distributed:
        return value
    if ctx.is_main:
        data = torch.frombuffer(bytearray(json.dumps(value, separators=(",", ":")).encode()),
                                dtype=torch.uint8).to(ctx.device)
        size = torch.tensor([data.numel()], dtype=torch.long, device=ctx.device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=ctx.device)
    dist.broadcast(size, src=0)
    if not ctx.is_main:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=ctx.device)
    dist.broadcast(data, src=0)
    return value if ctx.is_main else json.loads(bytes(data.cpu().numpy()).decode())


def broadcast_rollouts(rollouts: list[Rollout] | None, ctx: DistContext) -> list[Rollout]:
    """Rank 0's rollouts on every rank (others pass ``None``). Collective."""
    if not ctx.is_distributed:
        if rollouts is None:
            raise ValueError("a single process must pass its rollouts")
        return rollouts
    if ctx.is_main and rollouts is None:
        raise ValueError("rank 0 must pass the rollouts to broadcast")
    payload = broadcast_json(rollouts_to_json(rollouts) if ctx.is_main else None, ctx)
    return rollouts if ctx.is_main else rollouts_from_json(payload)


def shard_units(rollouts: list[Rollout]) -> list[list[int]]:
    """The indivisible parts of a step, as lists of indices in list order: each grpo group
    (``group_id >= 0``) whole, each ungrouped rollout alone; ordered by first member."""
    units: dict[tuple[bool, int], list[int]] = {}
    for i, rollout in enumerate(rollouts):
        key = (True, rollout.group_id) if rollout.group_id >= 0 else (False, i)
        units.setdefault(key, []).append(i)
    return sorted(units.values(), key=lambda unit: unit[0])


def shard_rollouts(rollouts: list[Rollout], ctx: DistContext) -> list[Rollout]:
    """This rank's share of the step's rollouts (identical input on every rank).

    The parts of :func:`shard_units` (a grpo group never spans two ranks, so its
    statistics are computed on one), balanced by action tokens: parts in
    decreasing token count (ties: list order) go to the least-loaded rank (ties:
    lowest rank); each share keeps list order. Every rank must get at least one
    part, because FSDP's collectives need every rank in every forward and
    backward: a step needs at least ``world_size`` parts, else ValueError.
    """
    if not ctx.is_distributed:
        return list(rollouts)
    units = shard_units(rollouts)
    if len(units) < ctx.world_size:
        raise ValueError(f"{len(units)} rollouts or groups cannot be shared by {ctx.world_size} ranks; "
                         f"a step needs at least world_size of them")
    tokens_of = [sum(rollouts[i].num_action_tokens for i in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-tokens_of[u], units[u][0]))
    load = [(0, rank) for rank in range(ctx.world_size)]
    mine: list[int] = []
    for u in order:
        tokens, rank = heapq.heappop(load)
        if rank == ctx.rank:
            mine.extend(units[u])
        heapq.heappush(load, (tokens + tokens_of[u], rank))
    return [rollouts[i] for i in sorted(mine)]


def local_batch(rollouts: list[Rollout], ctx: DistContext, pad_token_id: int, policy_version: int) -> RolloutBatch:
    """This rank's batch of the step's ``rollouts`` (the same list on every rank): its share
    collated, with the whole step's rewards and the global token normaliser. Collective."""
    batch = collate(shard_rollouts(rollouts, ctx), pad_token_id, policy_version=policy_version)
    batch.step_rewards = step_rewards(rollouts)
    batch.token_normalizer = global_token_normalizer(batch, ctx)
    return batch


def global_token_normalizer(local_batch: RolloutBatch, ctx: DistContext) -> float:
    """``N_global / world_size``: the denominator each rank's token-mean loss uses.

    FSDP averages gradients over ranks, so with this denominator the averaged
    gradient equals the gradient of ``sum over all ranks' tokens / N_global``.
    Collective. ``N_global`` is floored at MIN_TOKEN_NORMALIZER.
    """
    local = local_batch.action_mask.sum().to(torch.float64)
    if not ctx.is_distributed:
        return max(float(local), MIN_TOKEN_NORMALIZER)
    total = local.reshape(1).to(ctx.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return max(float(total.item()), MIN_TOKEN_NORMALIZER) / ctx.world_size


def _key_fingerprint(keys: list[str]) -> int:
    return zlib.crc32("\n".join(keys).encode())


def reduce_metrics(metrics: dict[str, float], ctx: DistContext,
                   summed: Collection[str] = SUMMED_METRICS) -> dict[str, float]:
    """Metrics of the whole step: the mean over ranks (the sum for ``summed`` names, the maximum for
    :data:`MAXED_METRICS`).

    Collective; every rank must pass the same names (ValueError otherwise). A
    mean skips ranks whose value is NaN (e.g. explained variance of a share with
    one action token) and is NaN only when every rank's is. The mean is over
    ranks, not tokens: ranks with more tokens do not weigh more.
    """
    if not ctx.is_distributed:
        return dict(metrics)
    keys = sorted(metrics)
    fingerprint = torch.tensor([_key_fingerprint(keys), -_key_fingerprint(keys)], dtype=torch.float64,
                               device=ctx.device)
    dist.all_reduce(fingerprint, op=dist.ReduceOp.MAX)
    if fingerprint[0].item() != -fingerprint[1].item():
        raise ValueError("ranks report different metric names")
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=ctx.device)
    finite = ~torch.isnan(values)
    stacked = torch.stack([torch.where(finite, values, torch.zeros_like(values)), finite.to(torch.float64)])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    sums, counts = stacked[0].tolist(), stacked[1].tolist()
    reduced = {k: (s if k in summed else (s / c if c else math.nan)) for k, s, c in zip(keys, sums, counts)}
    maxed = [k for k in keys if k in MAXED_METRICS]
    if maxed:  # the same names on every rank (checked above), so every rank joins this reduction too
        highest = torch.tensor([metrics[k] if not math.isnan(metrics[k]) else -math.inf for k in maxed],
                               dtype=torch.float64, device=ctx.device)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        reduced.update({k: (v if v != -math.inf else math.nan) for k, v in zip(maxed, highest.tolist())})
    return reduced
