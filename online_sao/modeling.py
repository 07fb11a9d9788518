"""Loading a policy and its tokenizer from any local Hugging Face model directory, and the probe
that decides whether a model may run on packed rows (:func:`packs_correctly`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from online_sao.config import ConfigError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(model_dir: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The causal LM stored in ``model_dir`` (config + safetensors), on CPU, in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    # use_safetensors: a directory with only pickled weights (pytorch_model.bin) is refused, not unpickled
    return AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=DTYPES[dtype], use_safetensors=True)


TOKENIZER_PROBE = "Hello world"
"""Text every real tokenizer encodes to at least one id. A model directory without tokenizer files gave
``AutoTokenizer`` a Qwen2 tokenizer of one token anyway (every text encoded to nothing, no chat
template, padding with an ordinary id); which files a tokenizer reads depends on its class (a
tokenizer.json, SentencePiece's model, a vocab.txt, vocab.json and merges.txt, ...), so the
tokenizer loaded is tested, not the files."""


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in ``model_dir``; a model without a pad token pads with its eos token."""
    tokenizer = AutoTokenizer.from_pretrained(Path(model_dir))
    if not tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
        raise ConfigError(f"{model_dir} holds no usable tokenizer ({type(tokenizer).__name__} of {len(tokenizer)} "
                          f"token(s) encodes {TOKENIZER_PROBE!r} to nothing): copy the model's tokenizer files "
                          "beside its weights")
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


PACKING_PROBE_LENGTHS = (12, 4)
"""Tokens of the two sequences the packing probe puts in one row. The first is the longer: in a model
that lets the second attend to it, most of the second's attention lands on foreign tokens (a large
difference), and at 12 it is past the sliding window of small test models (8), so the probe also
sees whether packed rows keep the window."""

PACKING_TOLERANCE_EPS = 64.0
"""Largest probe difference (:func:`packing_difference`, in units of the machine epsilon of the
dtype the probe ran in) of a model whose packed rows are trusted. Rounding alone (the same numbers
multiplied in matrices of other shapes) measured up to 16 (Qwen2, Llama, Mistral with a window,
Gemma2, GPT-2, GPT-NeoX, Phi-3, 2 to 28 layers, float32 and bfloat16); a row whose sequences see
each other measured 200 (OPT in bfloat16) to 3e7 (in float32)."""

PackedRun = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(input_ids [1, L], position_ids [1, L])`` -> the per-token outputs ``[1, L, ...]`` of the forward
that a packed path runs (no attention mask: the restarts of the positions mark the sequences)."""

PACKING_VERDICT_ATTRIBUTE = "sao_packs_correctly"
"""Where a probed model keeps its verdict (an attribute of the model itself, so that it lives and dies
with the model, a deep copy inheriting it: the same architecture)."""


def packs_correctly(model: nn.Module, run: PackedRun, vocab_size: int, name: str) -> bool:
    """Whether ``model`` gives a packed row's sequences the outputs each gets alone: the verdict of
    :func:`packing_difference`, made at the first call for ``model`` and kept for its later ones.

    transformers builds the block-diagonal causal mask of a packed row from the restarts of its
    ``position_ids``, but only in the architectures that hand ``position_ids`` to their mask
    (not OPT: there a row's sequences attend to each other). A model that fails is logged once, as
    ``name`` with the measured difference; its callers then run it on padded batches."""
    verdict = getattr(model, PACKING_VERDICT_ATTRIBUTE, None)
    if verdict is None:
        difference = packing_difference(model, run, vocab_size)
        verdict = difference <= PACKING_TOLERANCE_EPS
        setattr(model, PACKING_VERDICT_ATTRIBUTE, verdict)
        if not verdict:
            log.warning("%s does not keep the sequences of a packed row apart (packed vs alone: %.3g x the "
                        "dtype's epsilon, tolerance %g); it runs on padded batches, same values, more work",
                        name, difference, PACKING_TOLERANCE_EPS)
    return verdict


def packing_verdict(model: nn.Module) -> bool | None:
    """The verdict :func:`packs_correctly` made for ``model``, None before its first probe. Reads it
    without probing: a critic sharded with FSDP2 may probe only from its own forward."""
    return getattr(model, PACKING_VERDICT_ATTRIBUTE, None)


@torch.no_grad()
def packing_difference(model: nn.Module, run: PackedRun, vocab_size: int) -> float:
    """The probe: two short sequences of fixed random ids (:data:`PACKING_PROBE_LENGTHS`) packed in one
    row against each run alone, ``max |packed - alone| / rms(alone)`` in units of the epsilon of the
    coarsest dtype in play (the parameters', the outputs', autocast's). In eval mode (dropout would
    differ between the runs); a few dozen tokens of work; the global random state is left alone."""
    parameter = next(model.parameters())
    device = parameter.device
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(vocab_size, (n,), generator=generator) for n in PACKING_PROBE_LENGTHS]
    positions = [torch.arange(n) for n in PACKING_PROBE_LENGTHS]
    modes = [(module, module.training) for module in model.modules()]  # each part's own: they may differ
    model.eval()
    try:
        packed = run(torch.cat(sequences)[None].to(device), torch.cat(positions)[None].to(device))[0]
        alone = torch.cat([run(ids[None].to(device), pos[None].to(device))[0]
                           for ids, pos in zip(sequences, positions)])
    finally:
        for module, training in modes:
            module.training = training
    dtypes = [parameter.dtype, packed.dtype]
    if torch.is_autocast_enabled(device.type):
        dtypes.append(torch.get_autocast_dtype(device.type))
    epsilon = max(torch.finfo(dtype).eps for dtype in dtypes)
    scale = alone.float().pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    return float((packed.float() - alone.float()).abs().max() / scale) / epsilon
