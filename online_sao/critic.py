"""The critic: a value model copied from the policy with frozen attention (SAO.md section 3).

The critic starts as a copy of the policy's transformer backbone (same
architecture, same weights) with a scalar head on the last hidden states.
With ``freeze_attention=True`` only the feed-forward blocks (MLP or MoE experts)
and the head train: attention projections, embeddings and norms are frozen.
The spec says "only the MLP / MoE projections and the head train", so
embeddings and norms are frozen too, not just attention.

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from online_sao.batch import pack_layout, shift_to_tokens
from online_sao.modeling import packs_correctly

FEED_FORWARD_MODULE_NAMES = frozenset({"mlp", "block_sparse_moe", "feed_forward"})
"""Names under which Qwen2/Qwen2-MoE/Llama/Mistral/Mixtral decoder layers hold
their MLP or MoE block; parameters below a module of one of these names train."""

ATTENTION_MODULE_NAMES = frozenset({"self_attn"})
"""Names of the attention block of a decoder layer in the Qwen2 and Llama families."""


def _path_parts(name: str) -> set[str]:
    return set(name.split("."))


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_index(name: str) -> int | None:
    """The decoder layer a parameter name sits in (``layers.<i>.``), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


class FreezeError(ValueError):
    """The critic's body cannot be frozen as asked for its architecture: a config choice
    (:func:`online_sao.algorithms.build_critic` reports it as one), not a bug."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument
        """The argument of :class:`ValueModel` that asked for it: ``freeze_attention`` or ``trainable_layers``."""


class ValueModel(nn.Module):
    """``forward(input_ids, attention_mask)`` -> values ``[B, T]``.

    Position ``t`` of the output is the value of the state just before token
    ``x_t`` is emitted: the head reads the hidden state at ``t - 1`` (which has
    seen ``x_0 .. x_{t-1}``) and :func:`~online_sao.batch.shift_to_tokens` moves
    it to ``t``; position 0 is 0. This is the alignment of
    :mod:`online_sao.batch`, so values line up with action masks and rewards.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, freeze_attention: bool = True,
                 trainable_layers: int | None = None) -> None:
        """``trainable_layers``: with ``freeze_attention``, only the feed-forward blocks of the
        last this many decoder layers train (None: of every layer)."""
        super().__init__()
        self.backbone = backbone
        dtype = next(backbone.parameters()).dtype
        self.head = nn.Linear(hidden_size, 1, dtype=dtype)
        # A zero head starts every value at 0: the first advantages are plain
        # returns instead of returns minus noise from a random projection.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.freeze_attention = freeze_attention
        if trainable_layers is not None and not freeze_attention:
            raise ValueError("trainable_layers needs freeze_attention (it narrows the trained feed-forward blocks)")
        if freeze_attention:
            self._freeze_all_but_feed_forward(trainable_layers)

    @classmethod
    def from_policy(cls, policy: nn.Module, freeze_attention: bool = True,
                    trainable_layers: int | None = None) -> "ValueModel":
        """A critic whose backbone is a deep copy of the policy's (``policy.base_model``).

        ``policy`` is a Hugging Face causal LM (e.g. ``Qwen2ForCausalLM``); its LM head
        is not copied. The policy itself is not modified.
        """
        backbone = copy.deepcopy(policy.base_model)
        return cls(backbone, hidden_size=policy.config.hidden_size, freeze_attention=freeze_attention,
                   trainable_layers=trainable_layers)

    def _freeze_all_but_feed_forward(self, trainable_layers: int | None = None) -> None:
        first = 0
        if trainable_layers is not None:
            indices = {_layer_index(n) for n, _ in self.backbone.named_parameters()} - {None}
            if not indices:
                raise FreezeError("trainable_layers", "trainable_layers: no parameter sits under a 'layers.<i>' module")
            if trainable_layers > len(indices):  # would train every layer while the config says otherwise
                raise FreezeError("trainable_layers", f"trainable_layers {trainable_layers}: the model has "
                                                      f"{len(indices)} decoder layers")
            first = max(indices) + 1 - trainable_layers
        trainable = 0
        for name, param in self.backbone.named_parameters():
            layer = _layer_index(name)
            keep = bool(_path_parts(name) & FEED_FORWARD_MODULE_NAMES) and (layer is None or layer >= first)
            param.requires_grad_(keep)
            trainable += keep
        if trainable == 0:
            names = ", ".join(sorted(FEED_FORWARD_MODULE_NAMES))
            raise FreezeError("freeze_attention",
                              f"no feed-forward parameters found under modules named {names}; cannot freeze "
                              f"attention for this architecture ({type(self.backbone).__name__}): set "
                              "`algorithm.freeze_critic_attention: false` to train the whole critic")

    @property
    def base_model(self) -> nn.Module:
        """The transformer body (as Hugging Face models name theirs)."""
        return self.backbone

    def attention_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter below a module named in ATTENTION_MODULE_NAMES."""
        return [(n, p) for n, p in self.backbone.named_parameters() if _path_parts(n) & ATTENTION_MODULE_NAMES]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def packs(self) -> bool:
        """Whether :meth:`forward` runs the backbone on packed rows: the packing probe's verdict on its
        hidden states (:func:`online_sao.modeling.packs_correctly`; the head starts at zero, so the
        values could not tell), made at the first call and kept. Under FSDP2 call it from the
        forward (the root's parameters are gathered there) or before sharding."""
        def hidden(ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return self.backbone(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state

        return packs_correctly(self, hidden, self.backbone.get_input_embeddings().num_embeddings,
                               f"the critic's {type(self.backbone).__name__}")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                packed: bool | None = None) -> torch.Tensor:
        """``packed``: run the backbone on the right-padded batch packed without padding
        (:class:`~online_sao.batch.PackedLayout`); the same values, to float rounding, as the
        padded run (``packed=False``) wherever a value is defined (positions 1 .. length).
        None (every learner caller): packed where :meth:`packs`, else padded."""
        if packed is None:
            packed = self.packs()
        if packed:
            layout = pack_layout(attention_mask)
            hidden = self.backbone(input_ids=layout.pack(input_ids), position_ids=layout.position_ids,
                                   use_cache=False).last_hidden_state
            per_position = layout.unpack(self.head(hidden).squeeze(-1).float())  # 0 on padding
        else:
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask.long()).last_hidden_state
            per_position = self.head(hidden).squeeze(-1).float()  # value after reading x_0..x_t
        return shift_to_tokens(per_position)
