"""Checking a published state dict against the model it is to be loaded into.

Runs before any weight is copied, so a refused version never touches the
serving model (which matters most when loading in place).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from online_sao.weights import CorruptWeights, verify_state_dict

MAX_NAMES_IN_MESSAGE = 5
"""How many offending tensor names a refusal lists."""


def _aliases(expected: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Names that share one storage in the model (tied weights), per name."""
    by_storage: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, tensor in expected.items():
        by_storage.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    return {name: group for group in by_storage.values() for name in group}


def complete_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Verify ``state`` for ``model`` and return it with tied aliases filled in.

    Refuses (``CorruptWeights``) unknown names, missing names (a missing tied
    alias such as ``lm_head.weight`` is taken from its twin), shape mismatches,
    float/non-float mismatches, non-finite values, values beyond the model's
    dtype (inf once cast) and tied tensors published with different values. The result loads with
    ``load_state_dict(strict=True)``.
    """
    expected = model.state_dict()
    return check_state_dict(state, expected, _aliases(expected))


def check_state_dict(state: dict[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                     aliases: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """:func:`complete_state_dict` against a description of the model instead of the model itself.

    For an engine whose model lives out of reach (vLLM's workers): ``expected`` maps each name of the
    model's state dict to a tensor of its shape and dtype (only those are read, so meta tensors do),
    ``aliases`` each name to the names tied to it, itself included. Both engines refuse the same
    weights for the same reasons because both run this.
    """
    verify_state_dict(state)
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CorruptWeights(f"unexpected tensors {unexpected[:MAX_NAMES_IN_MESSAGE]} "
                             f"({len(unexpected)} in all)")
    full = dict(state)
    missing = []
    for name in expected.keys() - state.keys():
        twin = next((a for a in aliases[name] if a in state), None)
        if twin is None:
            missing.append(name)
        else:
            full[name] = state[twin]
    if missing:
        raise CorruptWeights(f"missing tensors {sorted(missing)[:MAX_NAMES_IN_MESSAGE]} ({len(missing)} in all)")
    for name, tensor in full.items():
        want = expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise CorruptWeights(f"tensor {name} has shape {tuple(tensor.shape)}, the model has {tuple(want.shape)}")
        if tensor.is_floating_point() != want.is_floating_point():
            raise CorruptWeights(f"tensor {name} is {tensor.dtype}, the model has {want.dtype}")
        if want.is_floating_point() and tensor.numel() and \
                float(tensor.detach().abs().amax()) > torch.finfo(want.dtype).max:
            # finite as published (verify_state_dict), infinite once load_state_dict casts it
            raise CorruptWeights(f"tensor {name} has values beyond {want.dtype}'s range "
                                 f"({torch.finfo(want.dtype).max:g}): they would load as inf")
    for group in {tuple(g) for g in aliases.values() if len(g) > 1}:
        present = [name for name in group if name in state]
        if any(not torch.equal(state[present[0]], state[other]) for other in present[1:]):
            raise CorruptWeights(f"tensors {present} are tied in the model but differ in the published weights: "
                                 "only one of them could be served")
    return full
