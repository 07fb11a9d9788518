"""The straggler benchmark's Markdown report and plot."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
from pathlib import Path

import torch

from benchmarks.straggler.runner import LoopResult
from benchmarks.straggler.spec import MODES, LoopSpec, response_length

TARGET_RATIO = 3.0
"""Issues 6 and 17's aim: streaming trains at least this many times the synchronous loop's action tokens/s."""
POPULATION_DRAWS = 10_000
"""Requests whose drawn lengths give the reference mean length in the report."""
SHOWN_SECONDS = 20.0
"""The plot's engine panel shows the first seconds of each loop (its decode steps are many)."""


def population_mean_length(spec: LoopSpec, draws: int = POPULATION_DRAWS) -> float:
    """Mean length of requests 0..draws-1 of ``spec`` (what a loop trains on average once it is long)."""
    return statistics.mean(response_length(spec, i) for i in range(draws))


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _model_line(model_dir: str) -> str:
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(model_dir)
    return (f"{model_dir} ({mc.model_type}, hidden {mc.hidden_size}, {mc.num_hidden_layers} layers, "
            f"vocab {mc.vocab_size})")


def _row(i: int, r: LoopResult) -> str:
    return (f"| {r.spec.mode} | {i} | {r.trained} | {r.mean_trained_length:.1f} | {r.elapsed_s:.1f} | "
            f"{r.rollouts_per_s:.2f} | **{r.trained_tokens_per_s:.0f}** | "
            f"{r.learner_idle_share:.1%} | {r.generator_idle_share:.1%} |")


def _diagnostics(i: int, r: LoopResult) -> str:
    return (f"| {r.spec.mode} | {i} | {r.mean_decode_batch:.1f} | {r.prefill_share:.1%} | "
            f"{r.generated_tokens_per_s:.0f} | "
            f"{len(r.learner.steps)} | {r.trained / len(r.learner.steps):.1f} | {r.padding_share:.1%} | "
            f"{r.padding_share_unpacked:.1%} | "
            f"{r.version_lag_mean:.2f} | {r.generator.swaps} | {1000 * r.learner_cpu_per_token:.3f} | "
            f"{1000 * r.generator_cpu_per_token:.3f} | "
            f"{r.learner_cpu_share:.2f} | {r.generator_cpu_share:.2f} |")


def summary(results: list[LoopResult]) -> dict[str, dict[str, float]]:
    """Per mode, the mean over its runs of rollouts/s, trained tokens/s and the two idle shares."""
    out = {}
    for mode in MODES:
        runs = [r for r in results if r.spec.mode == mode]
        if runs:
            out[mode] = {"rollouts_per_s": statistics.mean(r.rollouts_per_s for r in runs),
                         "tokens_per_s": statistics.mean(r.trained_tokens_per_s for r in runs),
                         "learner_idle": statistics.mean(r.learner_idle_share for r in runs),
                         "generator_idle": statistics.mean(r.generator_idle_share for r in runs)}
    return out


def pair_ratios(results: list[LoopResult], metric: str = "trained_tokens_per_s") -> list[float]:
    """Streaming / sync ``metric`` of each back-to-back pair of runs (the runs come in pairs)."""
    pairs = zip(results[0::2], results[1::2])
    return [getattr(next(r for r in pair if r.spec.mode == "stream"), metric)
            / getattr(next(r for r in pair if r.spec.mode == "sync"), metric) for pair in pairs]


def _mode_mean(results: list[LoopResult], mode: str, metric: str) -> float:
    return statistics.mean(getattr(r, metric) for r in results if r.spec.mode == mode)


def contention_free_estimate(results: list[LoopResult]) -> dict[str, float]:
    """Trained tokens/s each loop would reach with a core of its own per process, from CPU
    time per token (mean over runs): sync runs generator and learner one after the
    other (their times add up), streaming runs them side by side (the slower bounds)."""
    def mean(mode: str, metric: str) -> float:
        return _mode_mean(results, mode, metric)

    sync = mean("sync", "learner_cpu_per_token") + mean("sync", "generator_cpu_per_token")
    stream = max(mean("stream", "learner_cpu_per_token"), mean("stream", "generator_cpu_per_token"))
    return {"sync": 1.0 / sync, "stream": 1.0 / stream}


def balanced_ceiling(results: list[LoopResult]) -> float:
    """The most streaming could gain over the synchronous loop, whatever the learner costs per
    token (l, the same in both loops): 1 + g_sync / g_stream, the generators' CPU per token (means
    over runs). The ratio (g_sync + l) / max(g_stream, l) rises with l while the generator bounds
    streaming and falls once the learner does; it peaks where l = g_stream."""
    return 1.0 + (_mode_mean(results, "sync", "generator_cpu_per_token")
                  / _mode_mean(results, "stream", "generator_cpu_per_token"))


def write_report(args, argv: list[str], results: list[LoopResult], plot: Path, load_before: float,
                 load_after: float) -> None:
    spec = results[0].spec
    lengths = [n for r in results for n in r.learner.planned_tokens.values()]
    means = summary(results)
    ratio = means["stream"]["tokens_per_s"] / means["sync"]["tokens_per_s"]
    rollout_ratio = means["stream"]["rollouts_per_s"] / means["sync"]["rollouts_per_s"]
    estimate = contention_free_estimate(results)
    t = spec.trainer
    end = f"{spec.rollouts} rollouts trained" if spec.rollouts is not None else f"{spec.duration_s} s"
    lines = [
        "# Stragglers: synchronous loop vs SAO streaming (CPU)", "",
        f"- command: `{shlex.join(['.venv/bin/python', 'benchmarks/bench_straggler.py', *argv])}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs, no GPU, shared with other work (1-min load "
        f"average {load_before:.1f} at start, {load_after:.1f} at the end); torch {torch.__version__}; "
        f"generator and learner in two processes with {args.threads} torch thread(s) each",
        f"- model: {_model_line(spec.model_dir)}",
        f"- lengths: lognormal(mu = log {spec.median_tokens}, sigma = {spec.sigma}) capped at {spec.max_tokens}, "
        f"exactly that many tokens per request (no stop token); trained rollouts' lengths: mean "
        f"{statistics.mean(lengths):.1f}, p50 {_percentile(lengths, 0.5):.0f}, p90 {_percentile(lengths, 0.9):.0f}, "
        f"max {max(lengths)} over {len(lengths)}",
        f"- sync: batches of {spec.groups_per_batch} groups x G = {spec.group_size} ({spec.batch_requests} requests), "
        f"trained when all are done; stream: {spec.concurrency} requests in flight, at most {spec.max_untrained} "
        f"untrained; engine max_batch_size {spec.max_batch_size}, KV layout {spec.kv_layout}"
        f"{', body compiled (serving.compile)' if spec.engine_compile else ''}, in both",
        f"- learner: {spec.algorithm.name}, K = {spec.algorithm.critic_updates}; min_rollouts {t.min_rollouts}, "
        f"token_budget {t.token_budget}, max_rollouts_per_step {t.max_rollouts_per_step}, max_wait_s {t.max_wait_s}; "
        f"every step publishes to a FileWeightStore and the engine hot-swaps"
        + (f"; bodies compiled (trainer.compile), {sum(r.learner.compile_s for r in results):.0f} s of untimed "
           "compiling steps before the first loop" if t.compile else ""),
        f"- each loop ends after {end}; seed {spec.seed}", "",
        "| loop | run | rollouts trained | mean length | seconds | rollouts/s | trained tokens/s | learner idle | "
        "generator idle |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[_row(i, r) for i, r in enumerate(results, 1)], "",
        "| loop | rollouts/s (mean) | trained tokens/s (mean) | learner idle (mean) | generator idle (mean) |",
        "|---|---:|---:|---:|---:|",
        *[f"| {mode} | {m['rollouts_per_s']:.2f} | {m['tokens_per_s']:.0f} | {m['learner_idle']:.1%} | "
          f"{m['generator_idle']:.1%} |" for mode, m in means.items()], "",
        f"**Streaming / sync trained tokens/s: {ratio:.2f}x** (target >= {TARGET_RATIO:.0f}x: "
        f"{'met' if ratio >= TARGET_RATIO else 'not met'}); per back-to-back pair: "
        f"{', '.join(f'{x:.2f}x' for x in pair_ratios(results))}. Rollouts/s: {rollout_ratio:.2f}x (pairs "
        f"{', '.join(f'{x:.2f}x' for x in pair_ratios(results, 'rollouts_per_s'))}).", "",
        f"Streaming trains rollouts in the order they finish, so a loop that ends while long ones are still being "
        f"generated has trained shorter rollouts than the draws' mean ({population_mean_length(spec):.1f} tokens "
        f"over {POPULATION_DRAWS} requests; compare the *mean length* column): its rollouts/s overstates its rate, "
        "its trained tokens/s does not.", "",
        f"Estimate without other work on the machine (a core per process; from CPU seconds per token, means over "
        f"runs): sync {estimate['sync']:.0f} trained tokens/s, stream {estimate['stream']:.0f}, "
        f"**{estimate['stream'] / estimate['sync']:.2f}x**. Sync adds the generator's and the learner's CPU time "
        "per token (they take turns); streaming is bounded by the larger of the two. Whatever the learner costs, "
        f"the ratio is at most **{balanced_ceiling(results):.2f}x** = 1 + the synchronous generator's CPU per token "
        "over the streaming one's (reached when the learner costs as much per token as the streaming generator).",
        "",
        "Diagnostics of the same runs:", "",
        "| loop | run | mean decode batch | prefill share | generated tokens/s | learner steps | rollouts/step | padding | "
        "padding if padded | "
        "version lag | swaps | learner CPU ms / token | generator CPU ms / token | learner CPU share in steps | "
        "generator CPU share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[_diagnostics(i, r) for i, r in enumerate(results, 1)], "",
        "Definitions: a loop's time runs from its common start to the end of the learner step that reached the "
        "rollout count. *learner idle*: share of that time outside learner steps (collate + SAO step + publish). "
        "*generator idle*: share with no engine prefill or decode step running (zero sequences decoding; weight "
        "loading and switching count as idle). *mean decode batch*: sequences per decode step, time-weighted. "
        "*prefill share*: share of the engine's prefill and decode time spent in prefills (in the flat KV layout a "
        "prompt that joins a running batch is prefilled inside a decode step and counts as decode time). "
        "*padding*: share of the packed positions the learner's forward passes ran on that hold no token; "
        "*padding if padded*: the same share of the collated B x T batch (what a padded learner runs on). *version lag*: learner version minus "
        "sampling version, mean over trained tokens. *learner CPU ms / token*: CPU time of the learner process in "
        "steps per trained action token (the work, little affected by other jobs); *generator CPU ms / token*: CPU "
        "time of the generator process per token its engine sampled (both as the estimate above uses them). "
        "*CPU share*: CPU seconds per wall "
        "second (learner: inside its steps; generator: over the loop, all its threads); below 1 means the process "
        "waited for a core.", "",
        f"![rollouts trained over time]({plot.name})", "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))


def write_plot(results: list[LoopResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sync": "tab:red", "stream": "tab:blue"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    seen: set[str] = set()
    for r in results:
        mode = r.spec.mode
        xs, ys = zip(*r.timeline())
        left.step(xs, ys, where="post", color=colours[mode], alpha=0.9 if mode not in seen else 0.5,
                  label=f"{mode} ({r.rollouts_per_s:.2f} rollouts/s)")
        if mode not in seen:
            decode = [(s.end - r.learner.start, s.batch_size) for s in r.generator.engine_steps
                      if s.kind == "decode" and 0 <= s.end - r.learner.start <= SHOWN_SECONDS]
            if decode:
                dx, dy = zip(*decode)
                right.plot(dx, dy, ".", markersize=2, color=colours[mode], label=mode)
        seen.add(mode)
    left.set(xlabel="seconds since the loop started", ylabel="rollouts trained", title="Rollouts trained over time")
    left.legend(loc="upper left")
    right.set(xlabel="seconds since the loop started", ylabel="sequences in the decode step",
              title=f"Engine batch occupancy (first run, first {SHOWN_SECONDS:.0f} s)")
    right.legend(markerscale=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
