"""The torch engine's check at construction: refuse a model whose served log-probs would not be its own.

The behaviour log-prob of every sampled token is what the learner's importance ratio divides by, so
an engine whose cache or mask handling does not fit a model must not start: it would serve (and log)
a distribution the model never had, and nothing downstream could tell. Two checks, both raising
:class:`~online_sao.config.ConfigError` naming the model type, the layout and what differs:

- :func:`windowed_attention`: the ``flat`` layout's mask (:mod:`.flat_kv`) lets a query see every
  earlier column of its sequence, with no attention window, and transformers passes a prepared 4D
  mask through unchanged, so a model with sliding-window (or chunked) attention layers would attend
  past its window once a sequence outgrows it (0.2-0.4 nats off on Mistral and Gemma2 in an
  audit). The ``padded`` layout hands the model a 2D mask, from which it builds its own windows.
  A window this small test cannot reach (thousands of tokens) is caught by the config alone.
- :func:`check_engine`: two prompts of different lengths served together through the engine's own
  loop (a batched prefill and :data:`SELF_CHECK_TOKENS` - 1 decode steps), their sampled tokens'
  log-probs compared with a plain forward of each sequence alone (no cache, the model's own
  masks). It fails for models the cache handling cannot run at all (a state-space model such as
  Mamba keeps no key/value cache) and for any that it runs differently.

The context the engines and the HTTP layer serve, :func:`served_context_length`, is chosen here for the
same reason: a longrope model is served within its original positions, whose rope factors no batch
changes (the check's short prompts could not see the difference).

The prompts, the comparison and the verdict (:func:`check_prompts`, :func:`largest_difference`,
:func:`refuse_a_difference`, :func:`refusal_of_a_failure`) are shared with the vLLM engine's check
(:mod:`.vllm_self_check`), whose reference is the transformers model the learner loads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from online_sao.config import ConfigError
from online_sao.sampling import nucleus_logprobs
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest, TokenEvent
from serving.engine.grouped_attention import GROUPED_SDPA

log = logging.getLogger(__name__)

SELF_CHECK_PROMPTS = ((5, 3, 8, 1, 9, 2, 7, 4), (6, 2, 9))
"""Token ids of the check's two prompts (taken modulo the vocabulary; their text does not matter).
Different lengths: the shorter one is padded (``padded``) or owns fewer columns (``flat``)."""
SELF_CHECK_TOKENS = 3
"""Tokens each prompt samples: one from the prefill, the others from decode steps of the batch."""
TOLERANCE_NATS = 1e-3
"""Largest |served - plain forward| log-prob accepted in float32 (or float64): a batch of another
shape rounds differently (at most 5e-7 measured on tiny models of 9 families, either layout); a wrong
mask, cache or position is off by hundredths of a nat or more."""
HALF_TOLERANCE_NATS = 0.5
"""The same in bfloat16 or float16: with 8 (11) significant bits, logits of a trained model (tens in
size) are rounded to steps of 0.1 or more, and differently for a batch of another shape (tiny random
models, whose logits are small, differ by 1e-3 at most); only a gross failure is told apart here
(windows are left to :func:`windowed_attention`)."""

WINDOWED_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention"})
"""``config.layer_types`` entries whose attention sees a window of the sequence, not all of it (other
kinds than full attention, such as a state-space layer, are left to the self-check)."""

FirstRound = Callable[[list[GenerationRequest]], Awaitable[list[list[TokenEvent]]]]
"""Serves requests admitted together in the engine loop's first round; the loop stops after."""


MASK_FROM_A_BUFFER_MODEL_TYPES = frozenset({"gpt_neo"})
"""Models whose attention takes its causal (and local) mask from a buffer of ``max_position_embeddings``
columns indexed by key position (GPT-Neo's ``bias``), not from the mask the engine passes: the flat
layout's row, every sequence's cache side by side, is wider than that, and its mask is not applied
(a hunt served GPT-Neo flat: log-probs 0.35 nats off, then 500s once rows outgrew 512 columns)."""


def windowed_attention(config) -> str | None:
    """What makes ``config``'s attention windowed (layer types of :data:`WINDOWED_LAYER_TYPES`, GPT-Neo's
    ``local`` attention layers, or a sliding window for every layer that a sequence within the model's
    positions can outgrow), or None."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    local = [kind for kind in getattr(config, "attention_layers", None) or () if kind == "local"]
    if local:  # gpt_neo: attention_types expanded to one kind per layer
        return f"{len(local)} local attention_layers, window_size {getattr(config, 'window_size', None)}"
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    positions = getattr(config, "max_position_embeddings", None)
    if layer_types is not None:  # authoritative where a config has them (gemma2/3, qwen2/3, ...)
        windowed = sorted(set(layer_types) & WINDOWED_LAYER_TYPES)
        return f"layer_types {windowed}, sliding_window {window}" if windowed else None
    # mistral, mixtral, phi3, starcoder2, ...: one window for every layer; qwen2-style configs turn
    # it off with use_sliding_window
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    if positions is not None and window >= positions:
        return None  # no sequence the model can hold outgrows it
    return f"sliding_window {window}"


def served_context_length(config) -> int | None:
    """The positions a sequence may fill when served (None: no limit known): the text config's
    ``max_position_embeddings`` (a composite config, such as Gemma3's ...ForConditionalGeneration, keeps it
    in ``text_config``), cut to ``original_max_position_embeddings`` for ``longrope`` rope scaling.

    Longrope (Phi-3) picks its short or long rope factors from the largest position id of the whole
    forward: in a batch, a short sequence beside one past the original length is computed with the long
    factors, and a sequence crossing it while decoding has its earlier tokens' keys from the short ones,
    while the learner's plain forward of the sequence uses one set throughout (0.58 nats apart in a test).
    Within the original length every forward uses the short factors."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    original = longrope_original_length(text)
    if original is not None and (positions is None or original < positions):
        log.warning("%s uses longrope rope scaling, whose factors depend on the longest sequence of a batch: "
                    "serving its original %d positions, not %s, so that every logged log-prob is the one a plain "
                    "forward of the sequence gives", getattr(text, "model_type", "the model"), original, positions)
        return original
    return positions


def longrope_original_length(text_config) -> int | None:
    """``original_max_position_embeddings`` of a text config with ``longrope`` rope scaling, else None."""
    parameters = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return None
    # transformers 5 nests the parameters per layer type where those differ ({"full_attention": {...}, ...})
    nested = [p for p in parameters.values() if isinstance(p, dict)]
    lengths = []
    for p in nested or [parameters]:
        if (p.get("rope_type") or p.get("type")) == "longrope":
            lengths.append(p.get("original_max_position_embeddings")
                           or getattr(text_config, "original_max_position_embeddings", None))
    lengths = [n for n in lengths if n is not None]
    return min(lengths) if lengths else None


def check_engine(model: nn.Module, kv_layout: str, first_round: FirstRound) -> None:
    """Refuse (ConfigError) a model that the engine in ``kv_layout`` would not serve with the model's own
    distribution; ``first_round`` is the engine's (the loop must not run yet)."""
    what = f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r})"
    where = f"the torch engine with serving.kv_layout: {kv_layout}"
    if kv_layout == "flat" and (window := windowed_attention(model.config)) is not None:
        raise ConfigError(f"{what} has windowed attention ({window}), which {where} does not apply (its mask "
                          "has no window): set serving.kv_layout: padded")
    if kv_layout == "flat" and getattr(model.config, "model_type", None) in MASK_FROM_A_BUFFER_MODEL_TYPES:
        raise ConfigError(f"{what} masks its attention with a buffer of max_position_embeddings columns, not the "
                          f"mask {where} passes (its rows hold every sequence's cache side by side): set "
                          "serving.kv_layout: padded")
    prompts = check_prompts(model.get_input_embeddings().num_embeddings)
    requests = check_requests(prompts)
    try:
        served = _on_a_thread_of_its_own(lambda: first_round(requests))
        difference = largest_difference(model, prompts, served)
    except Exception as exc:  # the model cannot be served this way at all: say so instead of at every request
        raise refusal_of_a_failure(what, where, prompts, exc, "The engine supports attention models whose "
                                   "key/value cache is a transformers DynamicCache") from exc
    refuse_a_difference(what, where, "a plain forward of the model", difference, next(model.parameters()).dtype,
                        "; try serving.kv_layout: padded" if kv_layout == "flat" else "")
    log.info("engine self-check: %s in %s agrees with a plain forward within %.2g nats", what, kv_layout, difference)


def check_prompts(vocab: int) -> list[list[int]]:
    """:data:`SELF_CHECK_PROMPTS` within a vocabulary of ``vocab`` tokens."""
    return [[t % vocab for t in prompt] for prompt in SELF_CHECK_PROMPTS]


def check_requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    """The check's requests: ``prompts`` sampled at temperature 1, top-p 1 (the log-softmax of the logits,
    which a plain forward gives), :data:`SELF_CHECK_TOKENS` tokens each, a seed each."""
    return [GenerationRequest(f"self-check-{i}", prompt, SamplingParams(max_tokens=SELF_CHECK_TOKENS, seed=i))
            for i, prompt in enumerate(prompts)]


def tolerance_for(dtype: torch.dtype) -> float:
    """The largest difference accepted for a model computing in ``dtype``."""
    return TOLERANCE_NATS if dtype in (torch.float32, torch.float64) else HALF_TOLERANCE_NATS


def refuse_a_difference(what: str, where: str, reference: str, difference: float, dtype: torch.dtype,
                        hint: str = "") -> None:
    """ConfigError when ``difference`` (served vs ``reference``, in nats) is above :func:`tolerance_for`
    ``dtype`` or NaN; ``what`` names the model, ``where`` the engine, ``hint`` ends the message."""
    tolerance = tolerance_for(dtype)
    if not difference <= tolerance:  # NaN too
        raise ConfigError(f"{what} served by {where} samples from another distribution than {reference}: "
                          f"log-probs differ by up to {difference:.3g} nats (tolerated: {tolerance:g} in {dtype}); "
                          f"its logged behaviour log-probs would be wrong{hint}")


def refusal_of_a_failure(what: str, where: str, prompts: list[list[int]], exc: BaseException,
                         advice: str) -> ConfigError:
    """The ConfigError for a self-check that raised ``exc``: the model cannot be served this way at all."""
    return ConfigError(f"{what} cannot be served by {where}: its self-check (two prompts of {len(prompts[0])} "
                       f"and {len(prompts[1])} tokens) failed with {type(exc).__name__}: {exc}. {advice}")


def _on_a_thread_of_its_own(make: Callable[[], Awaitable[list[list[TokenEvent]]]]) -> list[list[TokenEvent]]:
    """Run the coroutine ``make()`` returns on an event loop of its own: the engine may be built on a
    thread whose event loop runs (an async caller), which could not wait for it."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = asyncio.run(make())
        except BaseException as exc:  # raised again on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="engine-self-check")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def largest_difference(model: nn.Module, prompts: list[list[int]], served: list[list[TokenEvent]]) -> float:
    """Largest |served log-prob - the plain forward's| over the sampled tokens (sampled at temperature 1,
    top-p 1: the log-softmax of the logits)."""
    device = next(model.parameters()).device
    largest = 0.0
    with torch.inference_mode(), _transformers_attention(model):
        for prompt, events in zip(prompts, served):
            tokens = [e.token_id for e in events]
            ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:]
            logp = nucleus_logprobs(logits, 1.0, 1.0)
            want = logp.gather(-1, torch.tensor(tokens, device=device)[:, None]).squeeze(-1).double().cpu()
            got = torch.tensor([e.logprob for e in events], dtype=torch.float64)
            largest = max(largest, float((got - want).abs().max()))
    return largest


@contextmanager
def _transformers_attention(model: nn.Module) -> Iterator[None]:
    """``model`` with transformers' ``sdpa`` in place of the flat layout's :func:`.grouped_attention.grouped_sdpa`
    (which it replaced): the reference is the library's own forward, not one that shares our attention."""
    switched = getattr(model.config, "_attn_implementation", None) == GROUPED_SDPA
    if switched:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(GROUPED_SDPA)
