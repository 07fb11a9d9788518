"""Scaled-dot-product attention that keeps grouped key/value heads grouped under a mask.

With grouped-query attention (fewer key/value heads than query heads) transformers' ``sdpa``
attention copies every key/value head ``groups`` times before the kernel whenever a mask is
given and a query holds more than one token (``repeat_kv``), because some CUDA kernels cannot
take grouped heads with a mask. The flat KV layout (:mod:`.flat_kv`) is exactly that case, over
the whole cache row: the copy was 8.5% of its step (py-spy, the default model on a CPU).
``torch.nn.functional.scaled_dot_product_attention`` takes the grouped heads itself
(``enable_gqa``), so this function is transformers' ``sdpa`` without the copy: the same arithmetic.

It is registered under :data:`GROUPED_SDPA` with transformers' ``AttentionInterface`` (the
library's documented way to add an attention function) when an engine asks for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

GROUPED_SDPA = "online_sao_grouped_sdpa"
"""The attention implementation's name in transformers' registry."""


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """``query [B, H, Q, D]``, ``key``/``value [B, H_kv, K, D]`` (``H`` a multiple of ``H_kv``), ``attention_mask``
    ``[B, 1, Q, K]`` (additive or boolean) -> ``[B, Q, H, D]`` as transformers' attention functions return."""
    # transformers leaves the mask out of a causal batch without padding for the kernel to apply
    # causality itself (as its own sdpa does, so must this one)
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0, is_causal=causal,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` attention to :func:`grouped_sdpa`; True when switched.
    Any other implementation (eager, flash, a kernel) is left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", GROUPED_SDPA):
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    return model.config._attn_implementation == GROUPED_SDPA
