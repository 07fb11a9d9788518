"""Loading a policy and its tokenizer from any local Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import torch
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
