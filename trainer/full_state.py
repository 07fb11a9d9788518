"""Full state dicts of sharded models and their optimisers, for publishing weights and checkpoints.

Keyed by the unsharded parameter names in every world size, so a checkpoint written by two ranks
loads into one process and vice versa (tests/trainer/test_distributed.py). Every function is
collective under ``torchrun`` (every rank calls it); in one process it is a local copy.
"""

from __future__ import annotations

import logging
from typing import Any, Collection

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from trainer.distributed import DistContext, broadcast_json

log = logging.getLogger(__name__)

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Gather unsharded tensors to CPU; with a process group only rank 0 receives them."""


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _live_storages(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> set[int]:
    """Storages of the tensors training keeps updating in place (this rank's shards)."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for slots in optimizer.state.values() for v in slots.values() if isinstance(v, torch.Tensor)]
    return {ptr for ptr in map(_storage, tensors) if ptr != 0}


def _tree_storages(state: Any) -> set[int]:
    if isinstance(state, dict):
        return set().union(*map(_tree_storages, state.values())) if state else set()
    if isinstance(state, list):
        return set().union(*map(_tree_storages, state)) if state else set()
    return {_storage(state)} if isinstance(state, torch.Tensor) else set()


def _containers_copied(state: Any, clone_storages: Collection[int] = frozenset()) -> Any:
    """New dicts and lists around the same tensors, cloning those stored in ``clone_storages``.

    torch.distributed.checkpoint aliases in both directions: ``cpu_offload`` of a
    tensor already on the CPU is no copy (a world-1 optimiser state, and AdamW's
    CPU ``step`` counters in any world size, come back as the live tensors), and
    ``set_*_state_dict`` replace the values of the dict they are given (rank 0's
    full tensors are swapped for the model's DTensor shards). Gathered tensors,
    which are new, are not copied again.
    """
    if isinstance(state, dict):
        return {k: _containers_copied(v, clone_storages) for k, v in state.items()}
    if isinstance(state, list):
        return [_containers_copied(v, clone_storages) for v in state]
    if isinstance(state, torch.Tensor) and _storage(state) in clone_storages:
        return state.detach().clone()
    return state


def full_state_dict(model: nn.Module, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict on CPU, on rank 0; ``None`` on the other ranks.

    Collective: every rank must call it. Tensors are detached CPU tensors that do
    not alias the model's parameters (safe to keep while training continues).
    """
    if not ctx.is_distributed:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    state = get_model_state_dict(model, options=_GATHER)
    return _containers_copied(state, _live_storages(model)) if ctx.is_main else None


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None, ctx: DistContext) -> None:
    """Load rank 0's full state dict into the (sharded) model on every rank.

    Collective. Rank 0 passes the dict, the others pass ``None``; rank 0
    broadcasts and each rank keeps its shard. Missing or unexpected keys raise.
    """
    if not ctx.is_distributed:
        if state is None:
            raise ValueError("a single process needs the state dict to load")
        model.load_state_dict(state, strict=True)
        return
    if ctx.is_main and state is None:
        raise ValueError("rank 0 needs the state dict to load")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, _containers_copied(state) if ctx.is_main else {}, options=options)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict[str, Any]:
    """The optimiser's full state keyed by parameter name, on CPU (rank 0; ``{}`` elsewhere).

    Collective. Keyed by unsharded names in every world size, so a checkpoint
    moves between one process and several ranks.
    """
    fresh = not optimizer.state  # the same on every rank: they step, and clear, together
    state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if fresh:
        _undo_state_initialisation(optimizer)
        state = {**state, "state": {}}
    return _containers_copied(state, _live_storages(model, optimizer)) if ctx.is_main else {}


def _undo_state_initialisation(optimizer: torch.optim.Optimizer) -> None:
    """Empty the state torch's ``get/set_optimizer_state_dict`` give an optimiser that had none.

    They fill it with a zero-gradient, lr-0 ``step()`` (``_init_optim_state``): the weights do not
    move, but AdamW's step counters become 1, and the next real step would use step 2's bias
    correction (about a quarter smaller than step 1's). A checkpoint taken when the state is empty
    (after a drift restart clears it, or before the first step) must leave training as it was.
    """
    optimizer.state.clear()


KERNEL_FLAGS = ("fused", "foreach")
"""Param-group settings of torch's optimisers that choose the implementation, not the update."""

HYPERPARAMETERS = ("lr", "initial_lr", "weight_decay", "betas", "eps")
"""Param-group settings of the update that the configuration chooses (``initial_lr``: the base rate
of a learning-rate schedule, present when the optimiser has one)."""


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any] | None,
                         ctx: DistContext, name: str = "optimizer") -> None:
    """Restore what :func:`optimizer_state` returned; rank 0's copy is broadcast. Collective.

    The moments and step counters are the checkpoint's; the kernel flags and hyper-parameters are
    the optimiser's own, as constructed, but for a scheduled ``lr`` (:func:`_kept_settings`).
    ``name`` says whose, in the log line of a hyper-parameter the checkpoint had otherwise. A state that
    lacks a parameter the optimiser trains leaves it empty, with a warning; one of more parameters
    loads theirs (:func:`_of_trained_parameters`)."""
    if ctx.is_main and not state:
        raise ValueError("rank 0 needs the optimizer state to load")
    if ctx.is_main:
        state = _of_trained_parameters(model, optimizer, state, name)
    if not broadcast_json(ctx.is_main and state is not None, ctx):
        optimizer.state.clear()  # no moments rather than some: every parameter steps from the same start
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.is_distributed)
    # loading takes every param-group setting from the checkpoint: keep this process's kernel flags
    # (``algorithm.optimizer_kernel``), so a checkpoint of another kernel resumes on the configured
    # one, and its hyper-parameters, so an operator who lowers a rate (after a collapse, say) and
    # restarts, or a roll-back, trains on the configured rate rather than the checkpoint's
    configured = [_kept_settings(group) for group in optimizer.param_groups]
    fresh = broadcast_json(bool(ctx.is_main and not state["state"]), ctx)  # taken from an empty state
    set_optimizer_state_dict(model, optimizer, _containers_copied(state) if ctx.is_main else {}, options=options)
    if fresh:
        _undo_state_initialisation(optimizer)
    for group, settings in zip(optimizer.param_groups, configured):
        if ctx.is_main:
            _log_overridden(name, group, settings)
        group.update(settings)
    # Optimizer.load_state_dict keeps tensors that already have the right device and
    # dtype (the CPU step counters, a world-1 state): give the optimiser its own.
    given = _tree_storages(state) if ctx.is_main else set()
    for slots in optimizer.state.values():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor) and _storage(value) in given:
                slots[slot] = value.detach().clone()


def _of_trained_parameters(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                           name: str) -> dict[str, Any] | None:
    """``state`` (rank 0's, from :func:`optimizer_state`) with only the parameters ``optimizer`` trains,
    or None, with a warning, when it lacks one of them (or has other groups): the optimiser then starts
    empty (:func:`load_optimizer_state`). ``algorithm.freeze_critic_attention`` changes which critic
    parameters train: turned off, torch refused the state ("Missing optimizer state for parameter ...")
    at every restart. A parameter is known by any of its names (tied weights have several; the state
    names one)."""
    names: dict[int, set[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(param_name)
    trained = [[names.get(id(param), set()) for param in group["params"]] for group in optimizer.param_groups]
    saved = [set(group["params"]) for group in state["param_groups"]]
    if len(saved) != len(trained) or not all(all(known & held for known in group)
                                             for held, group in zip(saved, trained)):
        log.warning("the checkpoint's %s optimizer state lacks parameters it trains now (%d saved, %d trained; "
                    "algorithm.freeze_critic_attention changed?): its moments start empty", name,
                    sum(map(len, saved)), sum(map(len, trained)))
        return None
    kept = set().union(*(known for group in trained for known in group))
    left_out = sorted(set(state["state"]) - kept)
    if left_out:
        log.info("the checkpoint's %s optimizer state has moments of %d parameters it no longer trains "
                 "(algorithm.freeze_critic_attention or critic_trainable_layers changed?): left out", name,
                 len(left_out))
    return {**state, "state": {k: v for k, v in state["state"].items() if k in kept},
            "param_groups": [{**group, "params": [n for n in group["params"] if n in kept]}
                             for group in state["param_groups"]]}


def _kept_settings(group: dict[str, Any]) -> dict[str, Any]:
    """The settings of a freshly built ``group`` that a restore keeps (:func:`load_optimizer_state`)."""
    keys = [key for key in (*KERNEL_FLAGS, *HYPERPARAMETERS) if key in group]
    if "initial_lr" in group:
        # a scheduled rate is where its schedule stands, which the checkpoint holds: the schedule's
        # owner sets it again from the configured initial_lr (trainer.state), once the schedule is loaded
        keys.remove("lr")
    return {key: group[key] for key in keys}


def _log_overridden(name: str, restored: dict[str, Any], configured: dict[str, Any]) -> None:
    """One line for each hyper-parameter the checkpoint had otherwise than configured."""
    for key in HYPERPARAMETERS:
        if key not in configured or key not in restored:
            continue
        old, new = restored[key], configured[key]
        if isinstance(new, tuple):
            old = tuple(old)  # betas: a list after the checkpoint's JSON
        if old != new:
            log.info("%s %s %s in the checkpoint, %s configured: using %s", name, key, old, new, new)
