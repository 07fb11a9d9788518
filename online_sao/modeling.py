"""Loading a policy and its tokenizer from any local Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(model_dir: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The causal LM stored in ``model_dir`` (config + safetensors), on CPU, in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    # use_safetensors: a directory with only pickled weights (pytorch_model.bin) is refused, not unpickled
    return AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=DTYPES[dtype], use_safetensors=True)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in ``model_dir``; a model without a pad token pads with its eos token."""
    tokenizer = AutoTokenizer.from_pretrained(Path(model_dir))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def compile_body(model: nn.Module) -> nn.Module:
    """Compile ``model``'s transformer body (``base_model``: a Hugging Face model's decoder stack,
    a :class:`~online_sao.critic.ValueModel`'s backbone) in place with ``torch.compile``; returns it.

    The body, not the whole model: the learner calls the policy's body directly to run its LM head
    only where an action token is predicted (:func:`online_sao.train_step.policy_forward`), and the
    heads are one matrix product each. In place (``nn.Module.compile``), so parameter names, state
    dicts and checkpoints stay those of the eager model. ``dynamic=True``: packed batches change
    their rows and lengths every step, and one graph serves them all (a static graph would be
    compiled again for each new shape)."""
    body = model.base_model
    body.compile(dynamic=True)
    return body


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model``'s body runs compiled (:func:`compile_body`). A deep copy of a compiled
    module does not: ``copy.deepcopy`` leaves the copy eager."""
    return model.base_model._compiled_call_impl is not None
