"""Serving throughput on the device: the native engine (both KV layouts) against ``generate``, and vLLM where it imports.

Model: the default architecture at ``--size`` with random weights in ``--dtype``
(speed does not depend on the weights). Each engine answers closed loops of
``c`` clients (a client sends its next request when its last one ends) with
prompts of 24 random tokens and exactly ``--new-tokens`` sampled tokens each,
at temperature 1; ``transformers`` ``model.generate`` runs the same prompts one
after another as the baseline. vLLM needs a model directory with a tokenizer:
the weights are saved with a byte-level tokenizer of 256 tokens (prompts are
token ids, so the tokenizer only has to load).

    python benchmarks/gpu/engines.py --out engines.json [--size half-b] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_engine import closed_loop, prompts  # noqa: E402
from benchmarks.gpu.common import device, machine, profile_summary, random_model, synchronize, write_result  # noqa: E402
from online_sao.config import ServingConfig  # noqa: E402
from serving.engine.torch_engine import TorchEngine  # noqa: E402


def sampling_config(new_tokens: int) -> GenerationConfig:
    """``generate``'s settings for the engines' workload: exactly ``new_tokens`` tokens, temperature 1."""
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                            temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0)


def generate_rate(model, prompt_list: list[list[int]], new_tokens: int, where: torch.device) -> float:
    """Tokens/s of sequential ``model.generate`` (batch 1, no early stop)."""
    config = sampling_config(new_tokens)
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_list[0]], device=where), generation_config=config)  # warm-up
        synchronize(where)
        start, produced = time.perf_counter(), 0
        for p in prompt_list:
            out = model.generate(torch.tensor([p], device=where), generation_config=config)
            produced += out.shape[1] - len(p)
        synchronize(where)
    return produced / (time.perf_counter() - start)


def engine_rates(engine, vocab: int, concurrency: list[int], new_tokens: int) -> dict[str, float]:
    """Tokens/s of ``engine`` in closed loops of each concurrency (two rounds of requests per client)."""
    rates = {}

    async def main():
        await engine.start()
        await closed_loop(engine, prompts(2, vocab), 1, 8)  # warm-up
        for c in concurrency:
            rates[str(c)] = await closed_loop(engine, prompts(2 * c, vocab), c, new_tokens)
        await engine.stop()

    asyncio.run(main())
    return rates


def single_request_profiles(model, engine, vocab: int, new_tokens: int, where: torch.device) -> dict:
    """One request alone (``new_tokens`` sampled tokens) under the profiler, per token: through
    ``generate`` and through ``engine``. Where the GPU idles while the wall clock runs, the host is
    the limit (launches, waits, Python); the wait counts say how often the host stopped for the GPU."""
    prompt = prompts(1, vocab)
    config = sampling_config(new_tokens)

    def generate() -> None:
        with torch.inference_mode():
            model.generate(torch.tensor(prompt, device=where), generation_config=config)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        loop.run_until_complete(closed_loop(engine, prompt, 1, new_tokens))  # warm-up
        served = profile_summary(lambda: loop.run_until_complete(closed_loop(engine, prompt, 1, new_tokens)),
                                 where, units=new_tokens)
        loop.run_until_complete(engine.stop())
    finally:
        loop.close()
    generate()
    return {"generate": profile_summary(generate, where, units=new_tokens), "torch_engine": served}


def byte_tokenizer(out: Path) -> None:
    """A 256-token byte-level tokenizer saved in ``out`` (what vLLM needs to load a model directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=sorted(alphabet)[0]).save_pretrained(out)


def vllm_rates(model, args, concurrency: list[int]) -> dict:
    """vLLM's rates on this device, or why it could not run."""
    try:
        import vllm
    except Exception as exc:  # an absent or broken vLLM is a finding of the check, not a failure
        return {"imported": False, "error": f"{type(exc).__name__}: {exc}"}
    from serving.engine.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        byte_tokenizer(Path(tmp))
        engine = VLLMEngine(tmp, ServingConfig(max_batch_size=max(concurrency)), dtype=args.dtype,
                            max_model_len=256, seed=0)
        rates = engine_rates(engine, model.config.vocab_size, concurrency, args.new_tokens)
    return {"imported": True, "version": vllm.__version__, "tokens_per_s": rates}


def run(args) -> dict:
    where = device()
    torch.manual_seed(0)
    model = random_model(args.size, args.dtype, where).eval()
    vocab = model.config.vocab_size
    concurrency = [int(c) for c in args.concurrency.split(",")]
    baseline = generate_rate(model, prompts(args.generate_prompts, vocab), args.new_tokens, where)
    native = engine_rates(TorchEngine(model, cfg=ServingConfig(max_batch_size=max(concurrency))), vocab,
                          concurrency, args.new_tokens)
    # the flat KV layout switches its model's attention function: a copy of its own
    flat = engine_rates(TorchEngine(copy.deepcopy(model), cfg=ServingConfig(max_batch_size=max(concurrency),
                                                                           kv_layout="flat")),
                        vocab, concurrency, args.new_tokens)
    return {"machine": machine(where), "size": args.size, "dtype": args.dtype,
            "parameters": sum(p.numel() for p in model.parameters()), "new_tokens": args.new_tokens,
            "generate_tokens_per_s": baseline, "torch_engine_tokens_per_s": native,
            "torch_engine_flat_tokens_per_s": flat,
            "profiles_c1": single_request_profiles(model, TorchEngine(model, cfg=ServingConfig(max_batch_size=1)),
                                                   vocab, args.new_tokens, where),
            "vllm": vllm_rates(model, args, concurrency)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=["half-b", "tiny"], default="half-b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    parser.add_argument("--generate-prompts", type=int, default=4, help="prompts of the generate baseline")
    args = parser.parse_args(argv)
    return write_result(args.out, "engines", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
