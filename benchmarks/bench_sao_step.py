"""Time one SAO learner step on CPU, split into its phases (issue 3, performance).

A batch of ``--rollouts`` rollouts, each a ``--prompt-tokens`` prompt followed by
``--action-tokens`` action tokens with the reward on the last one, trained with
the default model (``BaseModelConfig`` defaults). The trained base model is used
when it is built under the configured data dir; otherwise the same architecture
with random weights (the output says which). The step's phase timings come from
the ``time_<phase>_s`` metrics :class:`online_sao.sao.SAO` reports.

    .venv/bin/python benchmarks/bench_sao_step.py [--steps 5] [--out benchmarks/results/sao_step.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from online_sao.advantages import skip_observation_gae
from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, collate
from apps.config import load_app_config
from online_sao.critic import ValueModel
from online_sao.train_step import policy_logprobs

PHASES = ["critic_forward", "critic_backward", "critic_optimizer", "policy_forward", "policy_backward",
          "policy_optimizer", "arithmetic"]


def load_policy(cfg) -> tuple[torch.nn.Module, str]:
    from apps.default_model.builder import is_built

    base = cfg.model.base
    if is_built(cfg.model_dir, base):
        return AutoModelForCausalLM.from_pretrained(cfg.model_dir), f"trained base model from {cfg.model_dir}"
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[base.architecture]
    config = config_class(vocab_size=base.vocab_size, hidden_size=base.hidden_size,
                          intermediate_size=base.intermediate_size, num_hidden_layers=base.num_layers,
                          num_attention_heads=base.num_heads, num_key_value_heads=base.num_kv_heads,
                          max_position_embeddings=base.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return model, f"random weights, {base.architecture} architecture of BaseModelConfig defaults (no built base model)"


def make_batch(policy, rollouts: int, prompt: int, actions: int, vocab: int):
    gen = torch.Generator().manual_seed(1)
    items = []
    for i in range(rollouts):
        ids = torch.randint(0, vocab, (prompt + actions,), generator=gen).tolist()
        mask = [False] * prompt + [True] * actions
        reward = float(torch.rand((), generator=gen))
        items.append(Rollout(f"r{i}", ids, mask, [0.0] * len(ids), [0] * len(ids), {len(ids) - 1: reward}))
    batch = collate(items, pad_token_id=0, policy_version=1)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--action-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sao_step.md"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    load = os.getloadavg()[0]
    cfg = load_app_config(environ={})
    policy, source = load_policy(cfg)
    critic = ValueModel.from_policy(policy, freeze_attention=cfg.algorithm.freeze_critic_attention)
    opt = build_optimizers(cfg.algorithm, policy, critic)
    algo = build_algorithm(cfg.algorithm, policy, critic, opt.policy, opt.critic, opt.critic_scheduler)
    batch = make_batch(policy, args.rollouts, args.prompt_tokens, args.action_tokens, policy.config.vocab_size)

    algo.step(batch)  # warm-up: first-call allocations and optimiser state
    per_phase = {p: [] for p in PHASES}
    totals = []
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = algo.step(batch)
        totals.append(time.perf_counter() - start)
        for p in PHASES:
            per_phase[p].append(metrics.get(f"time_{p}_s", 0.0))

    gae_times = []
    values = torch.randn(batch.rewards.shape)
    for _ in range(20):
        start = time.perf_counter()
        skip_observation_gae(batch.rewards, values, batch.action_mask, 1.0, 0.99)
        gae_times.append(time.perf_counter() - start)

    step_median = statistics.median(totals)
    rows = [(p, statistics.median(per_phase[p])) for p in PHASES]
    # per-step residual, so it cannot go negative the way a difference of medians can
    residual = [total - sum(per_phase[p][i] for p in PHASES) for i, total in enumerate(totals)]
    rows.append(("other (metrics, guards, bookkeeping)", statistics.median(residual)))
    arithmetic_share = statistics.median(per_phase["arithmetic"]) / step_median
    params = sum(p.numel() for p in policy.parameters())
    lines = [
        "# SAO step timing (CPU)",
        "",
        f"- command: `{' '.join(shlex.quote(a) for a in [sys.executable.split('/')[-1], *sys.argv])}`",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} logical CPUs (shared; 1-min load average {load:.1f} at start), "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads",
        f"- model: {source}; {params / 1e6:.2f} M policy parameters",
        f"- batch: {args.rollouts} rollouts x ({args.prompt_tokens} prompt + {args.action_tokens} action tokens), "
        f"K = {cfg.algorithm.critic_updates} critic updates",
        f"- median over {args.steps} steps after 1 warm-up step (each row its own median; shares need not sum to 100%)",
        "",
        "| phase | seconds | share of step |",
        "|---|---:|---:|",
        *[f"| {name} | {sec:.4f} | {100 * sec / step_median:.1f}% |" for name, sec in rows],
        f"| **step** | **{step_median:.4f}** | 100% |",
        "",
        f"GAE + loss arithmetic: {100 * arithmetic_share:.2f}% of the step (target < 5%).",
        f"skip_observation_gae alone on [{args.rollouts}, {batch.rewards.shape[1]}]: "
        f"{1e3 * statistics.median(gae_times):.3f} ms (median of 20).",
        "",
    ]
    report = "\n".join(lines)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
