"""CPU cost of one engine round at a full decode batch (issue 17: the generator's decode step).

Starts ``--batch`` requests of ``--new-tokens`` tokens together on a TorchEngine
whose ``max_batch_size`` is the batch, so after the prefills every round is one
decode step of the full batch. Measured over those rounds only: process CPU
seconds of the median round (the engine thread's model call, sampling, cache bookkeeping
and hand-over of the events, plus the asyncio consumers that read them) and wall
seconds of the median round. Process CPU time is what a loaded machine disturbs
least; ``--repeats`` runs give a median of those.

Only the engine's public API is used, so the same file measures an older tree
for a before/after comparison (run it with that tree on ``PYTHONPATH``).

    .venv/bin/python benchmarks/bench_decode_step.py [--batch 16] [--new-tokens 256] [--top-p 1.0] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch

from apps.config import BaseModelConfig, load_app_config
from apps.default_model.builder import is_built
from online_sao.config import ServingConfig
from online_sao.modeling import load_policy
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import StepStats, TorchEngine

PROMPT_LEN = 40
"""About the length of a corpus prompt in the chat template."""
WARMUP_ROUNDS = 5
"""Full-batch rounds left out at the start of each run (allocator and cache warm-up)."""


def load_model() -> torch.nn.Module:
    cfg = load_app_config(environ={})
    if not is_built(cfg.model_dir, BaseModelConfig()):
        from benchmarks.common import random_default_model

        return random_default_model(BaseModelConfig()).eval()
    return load_policy(cfg.model_dir).eval()


def one_run(model: torch.nn.Module, batch: int, new_tokens: int, top_p: float, seed: int) -> tuple[float, float]:
    """(process CPU s, wall s) of the median full-batch round of one run."""
    marks: list[tuple[float, float]] = []  # (process CPU, wall) at the end of each full-batch decode step

    def on_step(s: StepStats) -> None:
        if s.kind == "decode" and s.batch_size == batch:
            marks.append((time.process_time(), s.ended_at))
        elif marks:  # anything else between full rounds (a prefill, a smaller batch) ends the window
            marks.append((float("nan"), float("nan")))

    engine = TorchEngine(model, cfg=ServingConfig(max_batch_size=batch), on_step=on_step)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(seed)
    requests = [GenerationRequest(f"r{i}", torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist(),
                                  SamplingParams(temperature=1.0, top_p=top_p, max_tokens=new_tokens, seed=seed + i))
                for i in range(batch)]

    async def drain(request: GenerationRequest) -> None:
        async for _ in engine.generate(request):
            pass

    async def main() -> None:
        await engine.start()
        await asyncio.gather(*(drain(r) for r in requests))
        await engine.stop()

    asyncio.run(main())
    window = marks[WARMUP_ROUNDS:]
    cut = next((i for i, (c, _) in enumerate(window) if c != c), len(window))  # up to the first NaN
    window = window[:cut]
    if len(window) < 11:
        raise RuntimeError(f"only {len(window) - 1} full-batch rounds measured; raise --new-tokens")
    # the median round: a round another job's burst slowed down moves a mean, not the median
    cpu = statistics.median(b[0] - a[0] for a, b in zip(window, window[1:]))
    wall = statistics.median(b[1] - a[1] for a, b in zip(window, window[1:]))
    return cpu, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model()
    runs = [one_run(model, args.batch, args.new_tokens, args.top_p, seed=r) for r in range(args.repeats)]
    cpu = statistics.median(c for c, _ in runs)
    wall = statistics.median(w for _, w in runs)
    print(f"batch {args.batch}, top_p {args.top_p}: CPU {cpu * 1e3:.2f} ms / round "
          f"({args.batch / cpu:.0f} tokens per CPU s), wall {wall * 1e3:.2f} ms / round; "
          f"runs CPU ms {[round(c * 1e3, 2) for c, _ in runs]}; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
