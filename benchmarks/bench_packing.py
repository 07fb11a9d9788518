"""Learner model passes on packed rows against the padded batch, same rollouts (issue 17).

Rollouts as the straggler benchmark draws them: a 16-token prompt, then a response
whose length is lognormal (median ``--median``, ``--sigma``, capped at ``--max-tokens``);
``--rollouts`` per batch. Model: the default architecture and size with random
weights (speed does not depend on the weights). Timed: the model passes of one SAO
step, the learner's work apart from optimiser steps and arithmetic: K critic
updates' forward and backward, the critic's no-grad forward, the policy's forward
and backward, with the project's losses. Packed and padded take turns on the same
batches; each batch is timed once per layout after one warm-up batch.

    .venv/bin/python benchmarks/bench_packing.py [--batches 6] [--out benchmarks/results/packing.md]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import random_default_model, write_report  # noqa: E402
from apps.config import BaseModelConfig
from online_sao.advantages import length_adaptive_lambda, skip_observation_gae
from online_sao.algorithms import build_critic
from online_sao.batch import Rollout, RolloutBatch, collate, pack_layout, padded_share
from online_sao.config import AlgorithmConfig
from online_sao.losses import dis_policy_loss, value_loss
from online_sao.train_step import policy_logprobs

PROMPT_TOKENS = 16


def draw_batch(rng: random.Random, args, vocab: int):
    rollouts = []
    for i in range(args.rollouts):
        response = max(1, min(args.max_tokens, round(rng.lognormvariate(math.log(args.median), args.sigma))))
        n = PROMPT_TOKENS + response
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        mask = [t >= PROMPT_TOKENS for t in range(n)]
        logprobs = [-1.0 if m else 0.0 for m in mask]
        rollouts.append(Rollout(f"r{i}", ids, mask, logprobs, [0] * n, {n - 1: rng.random()}))
    return collate(rollouts, pad_token_id=0, policy_version=1)


def add_batch_arguments(parser: argparse.ArgumentParser, rollouts: int, batches: int) -> None:
    """The options of :func:`draw_batch` (rollouts per batch, response lengths), of how many
    batches are timed and of torch's threads."""
    parser.add_argument("--rollouts", type=int, default=rollouts, help="rollouts per batch")
    parser.add_argument("--median", type=int, default=32, help="median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on a response's length")
    parser.add_argument("--batches", type=int, default=batches, help="timed batches")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


def batches_line(args: argparse.Namespace, real_tokens: int) -> str:
    """The report's line on the batches :func:`draw_batch` drew with ``args``."""
    return (f"- batches: {args.batches} of {args.rollouts} rollouts, {PROMPT_TOKENS}-token prompt + lognormal response "
            f"(median {args.median}, sigma {args.sigma}, at most {args.max_tokens}); {real_tokens} real tokens in all")


def report_header(title: str, script: str, argv: list[str] | None, threads: int, load: float,
                  base: BaseModelConfig, learner: str) -> list[str]:
    """The first lines of a learner benchmark's report: title, command, machine, model."""
    command = shlex.join([".venv/bin/python", f"benchmarks/{script}", *(argv or sys.argv[1:])])
    return [
        f"# {title}", "",
        f"- command: `{command}`",
        f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs (shared; 1-min load average {load:.1f} "
        f"at start), torch {torch.__version__}, {threads} torch thread(s)",
        f"- model: default architecture and size ({base.architecture}, hidden {base.hidden_size}, {base.num_layers} "
        f"layers, vocab {base.vocab_size}), random weights; {learner}",
    ]


def model_passes(policy, critic, batch, cfg: AlgorithmConfig, packed: bool) -> float:
    """Seconds for the model passes of one SAO step (gradients computed, then dropped)."""
    mask = batch.action_mask
    start = time.perf_counter()
    for _ in range(cfg.critic_updates):
        values = critic(batch.input_ids, batch.attention_mask, packed=packed)
        _, targets = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, cfg.lambda_critic)
        value_loss(values, targets, mask, None)[0].backward()
    with torch.no_grad():
        values = critic(batch.input_ids, batch.attention_mask, packed=packed)
    advantages, _ = skip_observation_gae(batch.rewards, values, mask, cfg.gamma,
                                         length_adaptive_lambda(mask.sum(dim=1), cfg.lambda_alpha))
    logprobs = policy_logprobs(policy, batch, packed=packed)
    loss, _ = dis_policy_loss(logprobs, batch.rollout_logprobs, advantages, mask, cfg.eps_low, cfg.eps_high, None)
    loss.backward()
    seconds = time.perf_counter() - start
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    return seconds


@dataclass
class LearnerBench:
    """What a learner benchmark of this family runs on: its options, the machine's load when it
    started, the default model with random weights and its critic, and the batches' random draw."""

    args: argparse.Namespace
    load: float
    cfg: AlgorithmConfig
    base: BaseModelConfig
    policy: torch.nn.Module
    critic: torch.nn.Module
    rng: random.Random


def learner_bench(parser: argparse.ArgumentParser, argv: list[str] | None) -> LearnerBench:
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, base = AlgorithmConfig(), BaseModelConfig()
    policy = random_default_model(base)
    return LearnerBench(args, os.getloadavg()[0], cfg, base, policy, build_critic(cfg, policy), random.Random(0))


def alternate(bench: LearnerBench, run: Callable[[RolloutBatch, bool], float]
              ) -> tuple[dict[bool, float], dict[bool, list[float]], list[RolloutBatch]]:
    """``run(batch, arm)`` for both arms (True, False) on one warm-up batch, then on each of
    ``args.batches`` drawn batches, alternating which arm goes first. Returns the warm-up seconds
    and the timed seconds of each arm, and the timed batches."""
    vocab = bench.base.vocab_size
    warm = draw_batch(bench.rng, bench.args, vocab)
    warm_up = {arm: run(warm, arm) for arm in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    batches = []
    for k in range(bench.args.batches):
        batch = draw_batch(bench.rng, bench.args, vocab)
        batches.append(batch)
        for arm in ((True, False) if k % 2 else (False, True)):
            times[arm].append(run(batch, arm))
    return warm_up, times, batches


@dataclass
class Speed:
    """The two arms of :func:`alternate` on the same batches, in real tokens per second."""

    real_tokens: int
    """Real tokens of the timed batches."""
    rate: dict[bool, float]
    """Each arm's real tokens per second over all the batches."""
    ratios: list[float]
    """Per batch, the True arm's speed over the False arm's."""

    def line(self, label: str) -> str:
        """``label: <x>x over all batches; per batch <ratios>``."""
        return (f"{label}: {self.rate[True] / self.rate[False]:.2f}x over all batches; per batch "
                f"{', '.join(f'{r:.2f}' for r in self.ratios)}")


def speed(times: dict[bool, list[float]], batches: list[RolloutBatch]) -> Speed:
    total = sum(int(batch.attention_mask.sum()) for batch in batches)
    return Speed(total, {arm: total / sum(t) for arm, t in times.items()},
                 [slow / fast for fast, slow in zip(times[True], times[False])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser, rollouts=16, batches=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/packing.md"))
    bench = learner_bench(parser, argv)
    args, cfg, base, load = bench.args, bench.cfg, bench.base, bench.load
    _, times, batches = alternate(bench, lambda batch, packed: model_passes(bench.policy, bench.critic, batch, cfg,
                                                                            packed))
    shares = {"packed": [pack_layout(batch.attention_mask).padding_share for batch in batches],
              "padded": [padded_share(batch.attention_mask) for batch in batches]}
    measured = speed(times, batches)
    rate = measured.rate
    lines = [
        *report_header("Learner model passes: packed rows against the padded batch (CPU)", "bench_packing.py", argv,
                       args.threads, load, base, f"critic with frozen attention, K = {cfg.critic_updates}"),
        batches_line(args, measured.real_tokens), "",
        "| layout | padding share (mean over batches) | real tokens/s | seconds per batch (median) |",
        "|---|---:|---:|---:|",
        f"| padded | {100 * statistics.mean(shares['padded']):.1f}% | {rate[False]:.0f} | "
        f"{statistics.median(times[False]):.3f} |",
        f"| packed | {100 * statistics.mean(shares['packed']):.1f}% | {rate[True]:.0f} | "
        f"{statistics.median(times[True]):.3f} |", "",
        measured.line("Packed / padded real tokens per second") + ".", "",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
