"""Time to first token when a burst of requests reaches an idle engine (CPU).

``--burst`` requests with prompts of random lengths (``--min-prompt`` to
``--max-prompt`` tokens) are submitted at once to a TorchEngine whose
``max_batch_size`` holds them all. Measured per run, from the submission of the
burst: each request's time to its first token (p50 and the last one) and the
engine's prefill steps (how many, how many requests each). The median over
``--repeats`` runs is reported.

Only the engine's public API is used, so the same file measures an older tree
for a before/after comparison (run it with that tree first on ``PYTHONPATH``):

    .venv/bin/python benchmarks/bench_burst.py [--burst 16] [--repeats 7] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older tree there wins

from benchmarks.bench_decode_step import load_model  # noqa: E402
from online_sao.config import ServingConfig  # noqa: E402
from online_sao.schemas import SamplingParams  # noqa: E402
from serving.engine.base import GenerationRequest  # noqa: E402
from serving.engine import torch_engine  # noqa: E402
from serving.engine.torch_engine import StepStats, TorchEngine  # noqa: E402

NEW_TOKENS = 4
"""Tokens per request: the burst's first tokens are what is measured, the rest only ends it."""


def one_burst(model: torch.nn.Module, args: argparse.Namespace, seed: int) -> dict[str, float]:
    steps: list[StepStats] = []
    engine = TorchEngine(model, cfg=ServingConfig(max_batch_size=args.burst), on_step=steps.append)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.burst,), generator=g).tolist()
    requests = [GenerationRequest(f"b{i}", torch.randint(3, vocab, (n,), generator=g).tolist(),
                                  SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=seed + i))
                for i, n in enumerate(lengths)]
    first_token: list[float] = []

    async def one(request: GenerationRequest, sent: float) -> None:
        events = engine.generate(request)
        await events.__anext__()
        first_token.append(time.perf_counter() - sent)
        [_ async for _ in events]

    async def main() -> None:
        await engine.start()
        warm = GenerationRequest("warm-up", requests[0].prompt_ids, SamplingParams(max_tokens=2, seed=0))
        [_ async for _ in engine.generate(warm)]
        steps.clear()
        sent = time.perf_counter()
        await asyncio.gather(*(one(r, sent) for r in requests))
        await engine.stop()

    asyncio.run(main())
    prefills = [s.batch_size for s in steps if s.kind == "prefill"]
    return {"ttft_p50_s": statistics.median(first_token), "ttft_last_s": max(first_token),
            "prefill_steps": len(prefills), "requests_per_prefill": statistics.mean(prefills)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burst", type=int, default=16, help="requests submitted at once")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", type=Path, default=None, help="also write the result as Markdown here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model()
    runs = [one_burst(model, args, seed=r) for r in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    tree = Path(torch_engine.__file__).resolve().parents[2]  # the tree whose engine ran
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=tree).stdout.strip()
    line = (f"| {commit} | {args.burst} | {med['ttft_p50_s'] * 1e3:.1f} | {med['ttft_last_s'] * 1e3:.1f} | "
            f"{med['prefill_steps']:.0f} | {med['requests_per_prefill']:.1f} | "
            f"{[round(r['ttft_last_s'] * 1e3, 1) for r in runs]} |")
    print(line)
    if args.out is not None:
        header = [
            "# Time to first token for a burst of requests (CPU)", "",
            f"- command: `{shlex.join(['.venv/bin/python', 'benchmarks/bench_burst.py', *sys.argv[1:]])}`",
            f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}",
            f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs, 1-min load average "
            f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}, {args.threads} thread(s)",
            f"- burst: {args.burst} requests at once into an idle engine, prompts of {args.min_prompt}-"
            f"{args.max_prompt} random tokens, {NEW_TOKENS} new tokens each; median over {args.repeats} runs", "",
            "| tree (PYTHONPATH) | burst | TTFT p50 ms | TTFT of the last ms | prefill steps | requests per prefill "
            "| last TTFT per run ms |", "|---|---:|---:|---:|---:|---:|---|"]
        old = args.out.read_text().splitlines() if args.out.exists() else header
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(old + [line]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
