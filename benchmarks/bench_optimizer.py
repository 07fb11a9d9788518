"""A whole SAO step with each AdamW kernel (``algorithm.optimizer_kernel``), same batches, one run.

Batches as the straggler benchmark's streaming learner sees them: ``--rollouts``
rollouts of a 16-token prompt and a lognormal response (bench_packing's draw). The
default architecture and size with random weights; the behaviour log-probs are the
policy's own, so the step trains on every action token. The kernels take turns on
each batch (the order alternates), each from its own copy of the same models and
optimiser state, after one warm-up step each.

    .venv/bin/python benchmarks/bench_optimizer.py [--batches 12] [--out benchmarks/results/learner_optimizer.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_packing import PROMPT_TOKENS, add_batch_arguments, draw_batch, report_header  # noqa: E402
from benchmarks.common import random_default_model, write_report  # noqa: E402
from apps.config import BaseModelConfig  # noqa: E402
from online_sao.algorithms import build_algorithm, build_critic, build_optimizers  # noqa: E402
from online_sao.config import AlgorithmConfig  # noqa: E402
from online_sao.train_step import policy_logprobs  # noqa: E402

KERNELS = ("foreach", "fused")
OPTIMIZER_PHASES = ("time_policy_optimizer_s", "time_critic_optimizer_s")


def learner(kernel: str, policy: torch.nn.Module):
    cfg = AlgorithmConfig(optimizer_kernel=kernel)
    policy = copy.deepcopy(policy)
    critic = build_critic(cfg, policy)
    opts = build_optimizers(cfg, policy, critic)
    return build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser, rollouts=6, batches=12)  # 6: streaming's learner steps take 5-7 rollouts
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/learner_optimizer.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    base = BaseModelConfig()
    policy = random_default_model(base)
    rng = random.Random(0)
    batches = [draw_batch(rng, args, base.vocab_size) for _ in range(args.batches + 1)]
    with torch.no_grad():
        for batch in batches:
            batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    algos = {kernel: learner(kernel, policy) for kernel in KERNELS}
    step_s: dict[str, list[float]] = {k: [] for k in KERNELS}
    optimizer_s: dict[str, list[float]] = {k: [] for k in KERNELS}
    for algo in algos.values():
        algo.step(batches[0])  # warm-up: first-call allocations and optimiser state
    for i, batch in enumerate(batches[1:]):
        for kernel in (KERNELS if i % 2 else KERNELS[::-1]):
            start = time.perf_counter()
            metrics = algos[kernel].step(batch)
            step_s[kernel].append(time.perf_counter() - start)
            optimizer_s[kernel].append(sum(metrics[p] for p in OPTIMIZER_PHASES))
    tokens = sum(int(b.attention_mask.sum()) for b in batches[1:])
    ratio = sum(step_s["foreach"]) / sum(step_s["fused"])
    lines = [
        *report_header("A SAO step with each AdamW kernel (CPU)", "bench_optimizer.py", argv, args.threads, load,
                       base, f"sao, K = {AlgorithmConfig().critic_updates}"),
        f"- batches: {args.batches} of {args.rollouts} rollouts, {PROMPT_TOKENS}-token prompt + lognormal response "
        f"(median {args.median}, sigma {args.sigma}, at most {args.max_tokens}); {tokens} tokens in all", "",
        "| optimizer_kernel | step s (median) | optimizer steps s per SAO step (median) | tokens/s |",
        "|---|---:|---:|---:|",
        *[f"| {k} | {statistics.median(step_s[k]):.4f} | {statistics.median(optimizer_s[k]):.4f} | "
          f"{tokens / sum(step_s[k]):.0f} |" for k in KERNELS], "",
        f"foreach / fused step time over all batches: {ratio:.2f}x.", "",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
