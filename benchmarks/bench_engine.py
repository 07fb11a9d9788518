"""Throughput and hot-swap stalls of the native engine on CPU (issue 4, performance).

Model: the default model under data/models/base when it is built with the
default BaseModelConfig, else a random-weight model of that architecture (the
report says which; speed does not depend on the weights).

* tokens/s of ``TorchEngine`` at concurrency 1, 4 and 16 (closed loop: each of
  ``c`` clients sends its next request when the last one ends) against
  ``transformers`` ``model.generate`` run sequentially, same prompts, same
  number of new tokens (no early stop), sampling at temperature 1;
* decode-step stalls during a hot-swap while 16 requests stream: the longest
  gap between two decode steps while ``swap_weights`` runs, against the median
  gap outside it, for the spare-copy swap and the in-place one;
* the time to load a version from a FileWeightStore and switch to it.

    .venv/bin/python benchmarks/bench_engine.py [--new-tokens 64] [--threads 1] [--out benchmarks/results/engine.md]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import random_default_model  # noqa: E402
from apps.default_model.builder import is_built
from apps.config import BaseModelConfig, load_app_config
from online_sao.config import ServingConfig
from online_sao.modeling import load_policy
from online_sao.schemas import SamplingParams
from online_sao.weights import FileWeightStore
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import StepStats, TorchEngine

PROMPT_LEN = 24


def default_model() -> tuple[torch.nn.Module, str]:
    cfg = load_app_config()
    base = BaseModelConfig()
    if is_built(cfg.model_dir, base):
        return load_policy(cfg.model_dir).eval(), f"the built default model at {cfg.model_dir}"
    return random_default_model(base).eval(), f"a random-weight {base.architecture} model of the default size"


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def bench_generate(model, prompt_list, new_tokens: int) -> float:
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                              temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_list[0]]), generation_config=config)  # warm-up
        start = time.perf_counter()
        produced = 0
        for p in prompt_list:
            out = model.generate(torch.tensor([p]), generation_config=config)
            produced += out.shape[1] - len(p)
    return produced / (time.perf_counter() - start)


async def closed_loop(engine, prompt_list, concurrency: int, new_tokens: int) -> float:
    queue = list(enumerate(prompt_list))
    produced = 0

    async def client():
        nonlocal produced
        while queue:
            i, p = queue.pop()
            req = GenerationRequest(f"b{i}", p, SamplingParams(max_tokens=new_tokens, seed=i))
            async for _ in engine.generate(req):
                produced += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return produced / (time.perf_counter() - start)


def bench_engine(model, vocab, new_tokens: int) -> dict[int, float]:
    engine = TorchEngine(model, cfg=ServingConfig(max_batch_size=16))
    rates = {}

    async def main():
        await engine.start()
        await closed_loop(engine, prompts(2, vocab), 1, 8)  # warm-up
        for c in (1, 4, 16):
            rates[c] = await closed_loop(engine, prompts(max(4, 2 * c), vocab), c, new_tokens)
        await engine.stop()

    asyncio.run(main())
    return rates


SWAPS = 6
"""Swaps per mode, 0.25 s apart, while 16 requests stream."""


def bench_swap(model, vocab, in_place: bool, store: FileWeightStore, ref) -> dict:
    stats: list[StepStats] = []
    engine = TorchEngine(model, cfg=ServingConfig(max_batch_size=16, swap_in_place=in_place), on_step=stats.append)
    swaps: list[dict] = []

    def swap_while_running():
        while sum(s.kind == "decode" for s in stats) < 30:
            time.sleep(0.005)
        for version in range(ref.version, ref.version + SWAPS):
            start = time.perf_counter()
            state = store.load(ref.location, ref.checksum)
            result = engine.swap_weights(version, state)
            end = time.perf_counter()
            swaps.append(dict(start=start, end=end, load_switch_s=end - start, stall_s=result.stall_s))
            time.sleep(0.25)

    async def main():
        await engine.start()
        swapper = threading.Thread(target=swap_while_running)
        swapper.start()
        reqs = [GenerationRequest(f"s{i}", p, SamplingParams(max_tokens=400, seed=i))
                for i, p in enumerate(prompts(16, vocab))]
        await asyncio.gather(*(_drain(engine, r) for r in reqs))
        swapper.join()
        await engine.stop()

    asyncio.run(main())
    decodes = [s for s in stats if s.kind == "decode" and s.batch_size == 16]
    # (start of the later step, gap between the ends of two consecutive full-batch steps)
    gaps = [(b.ended_at - b.seconds, b.ended_at - a.ended_at) for a, b in zip(decodes, decodes[1:])]
    margin = 0.02  # the step that was running when a swap began or ended

    def in_window(t: float, sw: dict) -> bool:
        return sw["start"] - margin <= t <= sw["end"] + margin

    normal = sorted(g for t, g in gaps if not any(in_window(t, sw) for sw in swaps))
    for sw in swaps:
        sw["worst_gap_s"] = max((g for t, g in gaps if in_window(t, sw)), default=0.0)
    return dict(normal_median_s=statistics.median(normal), normal_p99_s=normal[int(0.99 * (len(normal) - 1))],
                normal_max_s=normal[-1], swaps=swaps)


async def _drain(engine, req):
    async for _ in engine.generate(req):
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, which = default_model()
    vocab = model.get_input_embeddings().num_embeddings
    print(f"model: {which}", flush=True)
    baseline = bench_generate(model, prompts(4, vocab), args.new_tokens)
    print(f"generate: {baseline:.1f} tok/s", flush=True)
    rates = bench_engine(model, vocab, args.new_tokens)
    print("engine:", {c: round(r, 1) for c, r in rates.items()}, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = FileWeightStore(tmp)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        ref = store.save(1, state)
        swaps = {mode: bench_swap(copy.deepcopy(model), vocab, mode == "in-place", store, ref)
                 for mode in ("spare-copy", "in-place")}
    for mode, r in swaps.items():
        ratios = [round(sw["worst_gap_s"] / r["normal_median_s"], 2) for sw in r["swaps"]]
        print(f"swap {mode}: worst gap / median step = {ratios}", flush=True)
    write_report(args, which, baseline, rates, swaps)
    return 0


def write_report(args, which, baseline, rates, swaps) -> None:
    lines = [
        "# Native engine: throughput and hot-swap stalls (CPU)", "",
        f"Command: `{shlex.join([sys.executable.split('/')[-1]] + sys.argv)}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other work, "
        f"torch {torch.__version__}, {args.threads} intra-op thread(s), {platform.python_version()}  ",
        f"Model: {which}  ",
        f"Prompts: {PROMPT_LEN} random token ids; {args.new_tokens} new tokens per request, no early stop, "
        "temperature 1.", "",
        "## Throughput", "",
        "| | tokens/s | x generate |", "|---|---:|---:|",
        f"| transformers `generate`, sequential | {baseline:.1f} | 1.0 |",
    ]
    for c, r in rates.items():
        lines.append(f"| TorchEngine, concurrency {c} | {r:.1f} | {r / baseline:.1f} |")
    lines += ["", "Target: >= 4x generate at concurrency 16.", "",
              f"## Hot-swap while 16 requests stream ({SWAPS} swaps per mode, 0.25 s apart)", "",
              "Gap = time between the ends of two consecutive decode steps of the full batch; `normal` gaps are "
              "those away from any swap (their p99 and max show the noise of the shared machine). "
              "`worst gap` is the longest gap while a swap ran (store read + checks + load + switch). "
              "`switch stall` is the pause of the decode loop for the switch itself (`SwapResult.stall_s`). "
              "`load+switch` is the wall time of reading the version from a FileWeightStore (checksum, "
              "finiteness) plus `swap_weights`. Swap 1 of the spare-copy mode also makes the spare copy "
              "(deepcopy, once).", "",
              "| mode | normal gap median / p99 / max | swap | worst gap | worst / median normal | switch stall "
              "| load+switch |", "|---|---|---:|---:|---:|---:|---:|"]
    for mode, r in swaps.items():
        normal = (f"{r['normal_median_s'] * 1e3:.2f} / {r['normal_p99_s'] * 1e3:.2f} / "
                  f"{r['normal_max_s'] * 1e3:.2f} ms")
        for i, sw in enumerate(r["swaps"], 1):
            lines.append(f"| {mode} | {normal if i == 1 else ''} | {i} | {sw['worst_gap_s'] * 1e3:.2f} ms "
                         f"| {sw['worst_gap_s'] / r['normal_median_s']:.2f} | {sw['stall_s'] * 1e3:.3f} ms "
                         f"| {sw['load_switch_s'] * 1e3:.1f} ms |")
    lines += ["", "Target: a swap stalls decoding for no more than 2 normal decode steps. The switch itself pauses "
              "the loop for `switch stall`; the rest of a worst gap is the swap's loading work (checksum, "
              "safetensors parse, finiteness and shape checks, copy) running beside decoding on the same cores, "
              "to be read against the p99/max of the normal gaps of this shared machine.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
