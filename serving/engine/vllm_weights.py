"""What the vLLM engine checks and reloads when it swaps weights.

A published state dict is checked as the native engine checks it
(:func:`.weights_check.check_state_dict`), against the model the native engine would load
from the same checkpoint, built without memory on the meta device (:class:`ServedLayout`):
the same names (tied ones as aliases), shapes and served dtype. After a reload of a model with
tied embeddings, :func:`refresh_tied_head` runs in each vLLM worker.

Kept apart from serving/engine/vllm_engine.py, which drives vLLM's loop: this is the checkpoint
and weight bookkeeping of a swap. It imports neither vLLM nor transformers at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from serving.engine.weights_check import check_state_dict


def checkpoint_names(model_dir: Path) -> frozenset[str]:
    """Tensor names of a safetensors checkpoint (headers only)."""
    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            names.update(fh.keys())
    return frozenset(names)


@dataclass(frozen=True)
class ServedLayout:
    """What a published state dict must hold to replace the weights vLLM serves from a checkpoint.

    ``expected`` is the state dict of the model the native engine would load from it (names, shapes,
    the served dtype for its floats), built on the meta device (no memory, no values); ``aliases`` maps
    each name to its tied names (one parameter under several names, such as ``lm_head.weight`` and the
    input embedding of a model with tied embeddings, whether or not the checkpoint stores both);
    ``stored`` holds the checkpoint's own names, those vLLM loaded at start.
    """

    expected: dict[str, torch.Tensor]
    aliases: dict[str, list[str]]
    stored: frozenset[str]

    @classmethod
    def of(cls, model_dir: Path, dtype: torch.dtype) -> "ServedLayout":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        expected = model.state_dict(keep_vars=True)  # keep_vars: a tied parameter is one object under each name
        by_parameter: dict[int, list[str]] = {}
        for name, tensor in expected.items():
            by_parameter.setdefault(id(tensor), []).append(name)
        return cls(expected, {name: group for group in by_parameter.values() for name in group},
                   checkpoint_names(model_dir))

    @property
    def nbytes(self) -> int:
        """Bytes of the model's parameters and buffers in the served dtype, a tied parameter once."""
        unique = {id(tensor): tensor for tensor in self.expected.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def checked(self, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The native engine's checks (``CorruptWeights`` names the refusal), then the tensors to reload:
        all of them but a tied twin the checkpoint does not store (vLLM loaded it from its twin)."""
        full = check_state_dict(state, self.expected, self.aliases)
        return [(name, tensor) for name, tensor in full.items() if name in self.stored or len(self.aliases[name]) == 1]


def refresh_tied_head(worker) -> None:
    """Runs in each vLLM worker after a reload of a model with tied embeddings.

    On CPU, vLLM keeps a packed copy of the embedding matrix for the output
    projection (made once after loading); the in-place reload updates the
    embedding but not that copy, so the head would keep the old weights. This
    repacks it from the reloaded embedding. Elsewhere it does nothing.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(worker.model_runner.get_model().lm_head, remove_weight=False)
