"""Learner memory over a long run: RSS, the join's id memory and Python objects step by step.

The real learner (``trainer.learner.train``) trains ``--steps`` steps in this process on the
in-memory stream backend with a retention (``InMemoryBackend(drop_committed=True)``: a record is
deleted once every group reading its topic has committed past it), so what grows is the learner, not the broker. Before
each step ``--per-step`` new interactions and their rewards are logged: copies of a pool sampled once
from the policy, with fresh ids, created now, at the newest version on the weights topic.

Every ``--sample-every`` steps, after ``gc.collect()``: VmRSS, glibc's malloc in use, the join's id
memory size (trainer/id_memory.py), gc's object count, the records the broker holds and, with
``--tracemalloc``, Python's allocations. The report: the samples, each one's least-squares slope over
steps ``--fit-from`` to the end (warm-up excluded) and a plot of RSS and malloc in use over steps.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_learner_memory.py [--steps 1500] [--sample-every 25]
        [--set reward.memory_s=10 --set reward.window_s=5] [--out benchmarks/results/learner_memory.md]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import platform
import shlex
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_learner import parse_overrides  # noqa: E402
from benchmarks.common import write_report  # noqa: E402
from apps.config import AppConfig, load_app_config  # noqa: E402
from apps.default_model.builder import build_base_model  # noqa: E402
from apps.default_model.corpus import iter_prompts  # noqa: E402
from online_sao.modeling import load_policy, load_tokenizer  # noqa: E402
from online_sao.schemas import Interaction, Reward, SamplingParams, WeightsNotice, decode  # noqa: E402
from streams.memory import InMemoryBackend  # noqa: E402
from streams.records import publish  # noqa: E402
from trainer.distributed import init_distributed  # noqa: E402
from trainer.id_memory import IdMemory  # noqa: E402
from trainer.learner import RunUntil, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TINY_MODEL = {"model.base.vocab_size": 512, "model.base.hidden_size": 32, "model.base.intermediate_size": 64,
              "model.base.num_layers": 2, "model.base.num_heads": 4, "model.base.num_kv_heads": 2,
              "model.base.max_position_embeddings": 256, "model.base.train_steps": 30, "model.base.batch_size": 16}
"""The test suite's tiny default model (tests/fixtures/models.py): steps are cheap, the learner's books are not."""
POOL = 32
"""Interactions sampled from the policy once; the traffic repeats them under fresh ids."""
LEARNER = {"kafka.partitions": 2, "trainer.poll_timeout_s": 0.01, "algorithm.policy_lr": 1e-3,
           "deploy.gate_min_rollouts": 4, "deploy.gate_min_ess": 1.0}
"""Settings of the run besides ``--set``: short polls, and a registry gate that decides on few rollouts."""


@dataclass(frozen=True)
class Sample:
    step: int  # steps trained before it was taken
    elapsed_s: float
    rss_kib: int
    malloc_kib: int | None  # see malloc_kib()
    id_memory: int
    """Ids the join remembers (every live IdMemory; ``type() is``: isinstance wakes lazy modules' getattr)."""
    gc_objects: int
    broker_records: int
    traced_kib: int | None  # Python's allocations with --tracemalloc, else None


def rss_kib() -> int:
    """The process's resident set (VmRSS, which /proc gives in KiB)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_kib() -> int | None:
    """KiB glibc's malloc has handed out and not got back (mallinfo2: heap chunks in use + mmapped ones);
    None without glibc 2.33+. RSS can hide growth that this shows (freed heap pages stay resident and new
    allocations reuse them first); Python's small objects are not in it (pymalloc maps its own arenas)."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) // 1024


@torch.no_grad()
def sample_pool(model_dir: Path, count: int, max_new_tokens: int) -> list[Interaction]:
    """``count`` interactions sampled from the policy on the corpus's prompts, each token's log-prob logged."""
    policy, tokenizer = load_policy(model_dir).eval(), load_tokenizer(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for _, _, p in iter_prompts()[:8]]
    pool = []
    for i in range(count):
        prompt, generator, logprobs = prompts[i % len(prompts)], torch.Generator().manual_seed(i), []
        ids = list(prompt)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(policy(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(torch.multinomial(logp.exp(), 1, generator=generator)))
            logprobs.append(min(float(logp[ids[-1]]), 0.0))
        pool.append(Interaction(interaction_id=f"pool-{i}", model="online-sao", prompt_ids=prompt,
                                response_ids=ids[len(prompt):], action_mask=[True] * max_new_tokens,
                                logprobs=logprobs, versions=[0] * max_new_tokens,
                                sampling=SamplingParams(max_tokens=max_new_tokens)))
    return pool


class Traffic:
    """Logs the pool's interactions under fresh ids at the newest version serving would know, rewarded."""

    def __init__(self, backend: InMemoryBackend, cfg: AppConfig, pool: list[Interaction]) -> None:
        self.topics, self.pool, self.sent, self.version = cfg.kafka.topics, pool, 0, 0
        self.producer = backend.producer()
        self.notices = backend.consumer([self.topics.weights], group_id=None, start="earliest")

    def log(self, count: int) -> None:
        for message in self.notices.poll(timeout_s=0.0):
            notice = decode(message.value, WeightsNotice)
            if notice.action != "champion":  # a champion notice moves no serving version
                self.version = notice.version
        now = time.time()
        for _ in range(count):
            source = self.pool[self.sent % len(self.pool)]
            interaction = source.model_copy(update={
                "interaction_id": f"bench-{self.sent:09d}", "created_at": now, "completed_at": now,
                "versions": [self.version] * len(source.versions)})
            publish(self.producer, self.topics.interactions, interaction)
            value = sum(t % 2 == 0 for t in interaction.response_ids) / max(len(interaction.response_ids), 1)
            publish(self.producer, self.topics.rewards, Reward(interaction_id=interaction.interaction_id,
                                                              value=value, source="bench"))
            self.sent += 1
        self.producer.flush()


def measure(step: int, started: float, backend: InMemoryBackend) -> Sample:
    gc.collect()
    objects = gc.get_objects()
    ids, count = sum(len(o) for o in objects if type(o) is IdMemory), len(objects)
    del objects  # else every object stays alive until the next sample
    traced = tracemalloc.get_traced_memory()[0] // 1024 if tracemalloc.is_tracing() else None
    return Sample(step, time.monotonic() - started, rss_kib(), malloc_kib(), ids, count, backend.records_held(),
                  traced)


def run(args: argparse.Namespace, workdir: Path, progress=print) -> tuple[AppConfig, Path, list[Sample]]:
    """Train ``args.steps`` steps with the traffic above; the config, the model and the samples."""
    where = {"paths.data_dir": str(workdir / "model"), **TINY_MODEL} if args.model == "tiny" else {
        "paths.data_dir": str(REPO / "data")}
    model_dir = Path(args.model_dir or build_base_model(load_app_config(environ={}, overrides=where)))
    cfg = load_app_config(environ={}, overrides={
        "paths.data_dir": str(workdir / "data"), "model.path": str(model_dir),
        "trainer.min_rollouts": args.per_step, "trainer.max_rollouts_per_step": args.per_step,
        **LEARNER, **parse_overrides(args.set)})
    backend = InMemoryBackend(cfg.kafka, drop_committed=True)
    backend.ensure_topics()
    traffic = Traffic(backend, cfg, sample_pool(model_dir, POOL, args.max_new_tokens))
    samples, started = [], time.monotonic()

    def take(step: int) -> None:
        s = measure(step, started, backend)
        samples.append(s)
        progress(f"step {s.step:6d}  {s.elapsed_s:7.1f} s  RSS {s.rss_kib / 1024:8.1f} MiB  malloc "
                 f"{(s.malloc_kib or 0) / 1024:7.1f} MiB  id memory {s.id_memory:6d}"
                 f"  gc objects {s.gc_objects:8d}  broker records {s.broker_records:5d}"
                 + (f"  traced {s.traced_kib} KiB" if s.traced_kib is not None else ""), flush=True)

    trained = [0]

    def before_step(rollouts):  # the last sample is before the last step: after it the learner is closed
        if trained[0] % args.sample_every == 0 or trained[0] == args.steps - 1:
            take(trained[0])
        trained[0] += 1
        traffic.log(args.per_step)  # the next step's data, while this one trains
        return rollouts

    if args.tracemalloc:
        tracemalloc.start()
    traffic.log(3 * args.per_step)
    train(cfg, backend, init_distributed(), RunUntil(max_steps=args.steps), before_step=before_step)
    tracemalloc.stop()
    return cfg, model_dir, samples


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def fitted(samples: list[Sample], fit_from: int, field: str) -> float | None:
    kept = [s for s in samples if s.step >= fit_from and getattr(s, field) is not None]
    return slope([s.step for s in kept], [getattr(s, field) for s in kept])


def write_plot(samples: list[Sample], fit_from: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, kept = [s.step for s in samples], [s for s in samples if s.step >= fit_from]
    fig, axis = plt.subplots(figsize=(9, 5))
    for field, name, colour in (("rss_kib", "RSS", "tab:blue"), ("malloc_kib", "malloc in use", "tab:orange")):
        if getattr(samples[0], field) is None:
            continue
        first = getattr(samples[0], field)
        axis.plot(steps, [(getattr(s, field) - first) / 1024 for s in samples], "o-", markersize=3, color=colour,
                  label=f"{name} (at step 0: {first / 1024:.0f} MiB)")
        b = fitted(samples, fit_from, field)
        if b is not None:  # the fitted line passes through the kept samples' mean
            mx, my = (sum(v) / len(kept) for v in zip(*((s.step, getattr(s, field)) for s in kept)))
            ends = [kept[0].step, kept[-1].step]
            axis.plot(ends, [(my + b * (x - mx) - first) / 1024 for x in ends], "--", color=colour,
                      label=f"{name} fit from step {fit_from}: {b:.2f} KiB/step")
    axis.set(xlabel="learner steps", ylabel="MiB above step 0", title="Learner memory over a long run")
    ids_axis = axis.twinx()
    ids_axis.plot(steps, [s.id_memory for s in samples], color="tab:green", alpha=0.6, label="id memory")
    ids_axis.set_ylabel("ids in the join's id memory")
    handles, labels = (a + b for a, b in zip(axis.get_legend_handles_labels(), ids_axis.get_legend_handles_labels()))
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize="small")  # below the axes: no line hidden
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args, argv: list[str], cfg: AppConfig, model_dir: Path, samples: list[Sample], plot: Path,
           load_before: float) -> list[str]:
    from transformers import AutoConfig

    mc, traced = AutoConfig.from_pretrained(model_dir), samples[0].traced_kib is not None

    def per_step(field: str, unit: str) -> str:
        b = fitted(samples, args.fit_from, field)
        return "n/a (fewer than two samples in the range)" if b is None else f"{b:.3f} {unit}/step"

    def mib(kib: int | None) -> str:
        return "n/a" if kib is None else f"{kib / 1024:.1f}"

    t, last = cfg.trainer, samples[-1]
    first = next((s for s in samples if s.step >= args.fit_from), last)
    return [
        "# Learner memory over a long run (CPU)", "",
        f"- command: `{shlex.join(['.venv/bin/python', 'benchmarks/bench_learner_memory.py', *argv])}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} logical CPUs (shared; 1-min load "
        f"average {load_before:.1f} at start), Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads",
        f"- model: {args.model_dir or args.model + ' model'} ({mc.model_type}, hidden {mc.hidden_size}, "
        f"{mc.num_hidden_layers} layers, vocab {mc.vocab_size}); algorithm {cfg.algorithm.name}",
        f"- learner: trainer.learner.train in this process on the in-memory backend with drop_committed "
        f"(records below every reading group's committed offset deleted); {args.per_step} new interactions "
        f"and rewards per step; checkpoint every {t.checkpoint_every}, publish every {t.publish_every} step(s); "
        f"reward.window_s {cfg.reward.window_s:g}, id memory horizon {cfg.reward.id_memory_s:g} s, "
        f"capacity {t.join_max_pending}; MLflow on SQLite every {cfg.mlflow.log_every_steps} steps",
        f"- {args.steps} steps, the last sample after {last.step} at {last.elapsed_s:.0f} s; tracemalloc "
        f"{'on' if traced else 'off'}", "",
        f"Least-squares slopes over steps {args.fit_from} to {last.step} (warm-up excluded):", "",
        f"- **RSS: {per_step('rss_kib', 'KiB')}** ({mib(first.rss_kib)} -> {mib(last.rss_kib)} MiB)",
        f"- **malloc in use: {per_step('malloc_kib', 'KiB')}** ({mib(first.malloc_kib)} -> "
        f"{mib(last.malloc_kib)} MiB)",
        f"- id memory: {per_step('id_memory', 'ids')} (now {last.id_memory})",
        f"- gc-tracked objects: {per_step('gc_objects', 'objects')}",
        f"- broker records held: {per_step('broker_records', 'records')}",
        *([f"- Python allocations (tracemalloc): {per_step('traced_kib', 'KiB')}"] if traced else []), "",
        "| step | seconds | RSS (MiB) | malloc in use (MiB) | id memory | gc objects | broker records |"
        + (" traced (KiB) |" if traced else ""),
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if traced else ""),
        *[f"| {s.step} | {s.elapsed_s:.1f} | {mib(s.rss_kib)} | {mib(s.malloc_kib)} | {s.id_memory} | "
          f"{s.gc_objects} | {s.broker_records} |" + (f" {s.traced_kib} |" if traced else "") for s in samples], "",
        "Each sample is taken before a step, after `gc.collect()`. RSS is VmRSS: all of it, but it moves in steps, "
        "as heap pages freed earlier stay resident and are reused first. The sampler's own `gc.get_objects()` "
        f"list ({last.gc_objects * 8 / 2**20:.1f} MiB, freed at once) is such a block: RSS can stay flat while the "
        "heap grows into it, or jump by about its size when it no longer fits. Malloc in use is glibc's mallinfo2 "
        "(heap chunks in use + mmapped ones), smooth: C allocations (torch, SQLite) and Python's blocks over 512 "
        "bytes (a big dict's table, a long list's array), not Python's small objects (pymalloc maps its arenas "
        "itself); those show in the gc count and, with `--tracemalloc`, in bytes.", "",
        f"![RSS over steps]({plot.name})", "",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500, help="learner steps to run")
    p.add_argument("--sample-every", type=int, default=25, help="steps between two samples")
    p.add_argument("--fit-from", type=int, default=200, help="first step of the slope's range (after the warm-up)")
    p.add_argument("--per-step", type=int, default=4, help="interactions logged per step (min and max rollouts)")
    p.add_argument("--max-new-tokens", type=int, default=6, help="tokens of each sampled answer")
    p.add_argument("--model", choices=["tiny", "default"], default="tiny",
                   help="tiny: built in a temporary directory; default: the default model in data/ (built if absent)")
    p.add_argument("--model-dir", help="an already built model instead of --model")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, OMP_NUM_THREADS)")
    p.add_argument("--tracemalloc", action="store_true", help="also trace Python's allocations (slower)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a learner config override, e.g. reward.memory_s=10 (repeatable; read as YAML)")
    p.add_argument("--out", type=Path, default=RESULTS / "learner_memory.md",
                   help="the report (Markdown); the plot goes beside it (.png)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.sample_every < 1:
        p.error("--steps and --sample-every must be at least 1")
    if args.out.is_dir():
        p.error(f"--out names a directory ({args.out}); give the report's file name")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-learner-memory-") as tmp:
        cfg, model_dir, samples = run(args, Path(tmp))
        plot = args.out.with_suffix(".png")
        write_plot(samples, args.fit_from, plot)
        lines = report(args, argv if argv is not None else sys.argv[1:], cfg, model_dir, samples, plot, load_before)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
