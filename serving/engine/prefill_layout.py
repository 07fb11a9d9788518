"""How the torch engine lays out one round's admitted prompts for prefill.

The round's admitted requests are cut, in order, into groups whose prompts fit
``ServingConfig.max_prefill_tokens`` (:func:`prefill_groups`); in the default layout each
group is prefilled in one forward with its prompts left-padded to the longest
(:func:`left_padded`). This is bookkeeping over token ids, apart from the engine's loop and
its model calls (serving/engine/torch_engine.py), so it lives on its own.
"""

from __future__ import annotations

import torch

from serving.engine.outbox import EngineSequence

PAD_TOKEN_ID = 0
"""Fills the left of a shorter prompt in a batched prefill. Any id in the vocabulary serves: its
positions are masked out of every attention and their cached keys and values are zeroed."""


def prefill_groups(admitted: list[EngineSequence], max_prefill_tokens: int,
                   flat: bool) -> list[list[EngineSequence]]:
    """``admitted`` in order, cut into groups whose prompts fit ``max_prefill_tokens`` (padded to the
    group's longest; in the ``flat`` layout, unpadded)."""
    groups: list[list[EngineSequence]] = []
    longest = total = 0
    for seq in admitted:
        prompt = len(seq.request.prompt_ids)
        length = max(longest, prompt)
        size = total + prompt if flat else length * (len(groups[-1]) + 1 if groups else 1)
        if groups and size <= max_prefill_tokens:
            groups[-1].append(seq)
            longest, total = length, size
        else:
            groups.append([seq])
            longest = total = prompt
    return groups


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``prompts`` left-padded with :data:`PAD_TOKEN_ID` to the
    longest, the mask 0 on the padding."""
    length = max(len(prompt) for prompt in prompts)
    pads = [length - len(prompt) for prompt in prompts]
    ids = torch.tensor([[PAD_TOKEN_ID] * pad + prompt for prompt, pad in zip(prompts, pads)],
                       dtype=torch.long, device=device)
    mask = torch.tensor([[0] * pad + [1] * (length - pad) for pad in pads], dtype=torch.long, device=device)
    return ids, mask
