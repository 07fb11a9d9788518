"""Learner throughput, share of time waiting for data, and freshness (issue 5, performance).

Everything runs as in production on one machine: a real Kafka broker (a local one
in a temporary directory unless ``--bootstrap`` names one), the default model,
serving's TorchEngine with its WeightsFollower in this process, and the learner
as its own process (``online-sao learn``) with MLflow on SQLite.

1. backlog: ``--backlog`` interactions are sampled by the engine and logged with
   their rewards before the learner starts; the learner drains them. Rollouts
   and action tokens trained per second over that drain are its capacity.
2. live: the engine answers one request after another (``--rate`` per second at
   most) for ``--duration`` seconds; each interaction is logged and its reward is
   logged right after it. Freshness of a reward: from the moment its reward was
   acknowledged by the broker to (a) the weights notice of the step that trained
   on it (the notice's ``created_at``) and (b) serving switching to those weights
   (the follower's applied swap; every answer from then on uses them).

Rollouts of a step, notices and swaps are joined by interaction id through the
learner's ledger and the notices' ``step``. Wall-clock times of the two processes
come from the same machine clock.

    .venv/bin/python benchmarks/bench_learner.py [--backlog 64] [--duration 60] [--rate 2]
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import yaml
from mlflow import MlflowClient
from transformers import AutoConfig

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import start_broker  # noqa: E402
from apps.default_model.builder import build_base_model
from apps.config import AppConfig, load_app_config
from apps.default_model.corpus import iter_prompts
from online_sao.modeling import load_tokenizer
from online_sao.schemas import Interaction, Reward, WeightsNotice, decode
from online_sao.weights import FileWeightStore
from serving.engine.torch_engine import TorchEngine
from serving.weights_follower import WeightsFollower
from streams.kafka_backend import KafkaBackend
from streams.records import publish
from trainer.checkpoint import read_ledger

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "learner.md"
WAIT_S = 900.0
"""Longest wait for the learner to catch up with what was logged."""
SETTLE_S = 20.0
"""No new rollout trained for this long (ten times max_wait_s) since the last one was: the learner has
trained all it will. An interaction read after its reward window closed (the backlog took longer than
reward.window_s to make on a busy machine) or with an empty answer is not trained; the report counts
those. The countdown starts at the first rollout trained, not when the wait starts: a learner still
loading its model and opening MLflow after SETTLE_S had trained nothing, the live traffic started on top
of the backlog, and steps that trained both counted in neither phase."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


class Traffic:
    """Samples interactions with the engine and logs them with their rewards."""

    def __init__(self, engine: TorchEngine, tokenizer, backend: KafkaBackend, cfg: AppConfig, max_new_tokens: int):
        self.engine, self.cfg, self.max_new_tokens = engine, cfg, max_new_tokens
        self.producer = backend.producer()
        self.prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=True)["input_ids"] for _, _, p in iter_prompts()]
        self.rewarded_at: dict[str, float] = {}
        self.count = 0

    def one(self) -> None:
        import asyncio

        from online_sao.schemas import SamplingParams
        from serving.engine.base import GenerationRequest

        iid = f"bench-{self.count:06d}"
        prompt = self.prompts[self.count % len(self.prompts)]
        sampling = SamplingParams(temperature=1.0, max_tokens=self.max_new_tokens, seed=self.count)
        self.count += 1

        async def collect():
            return [e async for e in self.engine.generate(GenerationRequest(iid, prompt, sampling))]

        events = asyncio.run(collect())
        interaction = Interaction(interaction_id=iid, model="online-sao", prompt_ids=prompt,
                                  response_ids=[e.token_id for e in events], action_mask=[True] * len(events),
                                  logprobs=[min(e.logprob, 0.0) for e in events],
                                  versions=[e.version for e in events], sampling=sampling)
        topics = self.cfg.kafka.topics
        publish(self.producer, topics.interactions, interaction)
        publish(self.producer, topics.rewards, Reward(interaction_id=iid, source="bench",
                                                     value=sum(t % 2 == 0 for t in interaction.response_ids)
                                                     / max(len(events), 1)))
        self.producer.flush()
        self.rewarded_at[iid] = time.time()


def settled_check(ids: set[str], trained: Callable[[], set[str]], clock: Callable[[], float]) -> Callable[[], bool]:
    """A predicate: True once every id in ``ids`` is trained, or once SETTLE_S seconds passed since the
    last change of what ``trained`` returns, counted from the first rollout trained (none trained yet:
    the learner may still be starting, so it waits on)."""
    last, changed = 0, None

    def settled() -> bool:
        nonlocal last, changed
        done = trained()
        if len(done) != last:
            last, changed = len(done), clock()
        return ids <= done or (changed is not None and clock() - changed > SETTLE_S)

    return settled


def wait_until_trained(ids: set[str], trained: Callable[[], set[str]], learner: subprocess.Popen) -> None:
    """Until every id in ``ids`` is trained, or nothing new was trained for SETTLE_S seconds since the
    first rollout was (at most WAIT_S)."""
    wait_until(settled_check(ids, trained, time.monotonic), WAIT_S, learner)


def wait_until(predicate, timeout_s: float, learner: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if learner.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the learner did not catch up in time")
        time.sleep(0.2)


def parse_overrides(pairs: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings as a dict, each value read as YAML (``1`` an int, ``null`` None)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants KEY=VALUE, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def nest(tree: dict, path: list[str], value: object) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating the sections on the way."""
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=64, help="interactions logged before the learner starts")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of live traffic")
    parser.add_argument("--rate", type=float, default=2.0, help="live requests per second at most")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--data-dir", default=str(REPO / "data"), help="where the default model is (built if absent)")
    parser.add_argument("--bootstrap", help="an existing Kafka cluster instead of a temporary local broker")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the learner and the traffic, e.g. trainer.min_rollouts=1 "
                             "(repeatable; the value is read as YAML)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the report (Markdown file)")
    args = parser.parse_args(argv)
    if args.out.is_dir():
        parser.error(f"--out names a directory ({args.out}); give the report's file name")
    load_before = os.getloadavg()[0]

    base_cfg = load_app_config(environ={}, overrides={"paths.data_dir": args.data_dir})
    model_dir = build_base_model(base_cfg)
    workdir = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker, kafka = start_broker(base_cfg, workdir)
        bootstrap = kafka.bootstrap
    raw = {"paths": {"data_dir": str(workdir / "data")}, "model": {"path": str(model_dir)},
           "kafka": {"bootstrap_servers": bootstrap}, "mlflow": {"tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
                                                              "log_every_steps": 1}}  # reads each step's history
    for key, value in parse_overrides(args.set).items():
        nest(raw, key.split("."), value)
    config_file = workdir / "learner.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    cfg = load_app_config(config_file, environ={})
    backend = KafkaBackend(cfg.kafka)
    backend.ensure_topics()

    engine = TorchEngine.from_pretrained(model_dir)
    engine.start_thread()
    swaps: dict[int, float] = {}  # version -> when serving switched to it

    def on_swap(result) -> None:
        if result.applied:
            swaps.setdefault(result.version, time.time())

    follower = WeightsFollower(backend, cfg.kafka.topics.weights, FileWeightStore(cfg.weight_store_url), engine,
                               on_result=on_swap)
    follower.start()
    traffic = Traffic(engine, load_tokenizer(model_dir), backend, cfg, args.max_new_tokens)
    for _ in range(args.backlog):
        traffic.one()
    backlog_ids = set(traffic.rewarded_at)

    ledger = cfg.checkpoint_dir
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    learner = subprocess.Popen([sys.executable, "-m", "apps.cli", "--config", str(config_file), "learn"],
                               cwd=REPO, env=env, stdout=open(workdir / "learner.log", "wb"), stderr=subprocess.STDOUT)

    def trained() -> set[str]:
        return {iid for _, iid in read_ledger(ledger)}

    try:
        wait_until_trained(backlog_ids, trained, learner)
        live_start = time.time()
        while time.time() - live_start < args.duration:
            started = time.monotonic()
            traffic.one()
            time.sleep(max(0.0, 1.0 / args.rate - (time.monotonic() - started)))
        live_s = time.time() - live_start
        wait_until_trained(set(traffic.rewarded_at), trained, learner)
        time.sleep(3.0)  # the last notice reaches serving
    finally:
        learner.send_signal(signal.SIGTERM)
        learner.wait(timeout=120)
        follower.stop()
        engine.stop_thread()
        traffic.producer.close()

    lines = analyse(args, argv, cfg, model_dir, ledger, backlog_ids, traffic, swaps, live_s, load_before, backend, env)
    if broker is not None:
        broker.stop()
    print("\n".join(lines))
    args.out.write_text("\n".join(lines) + "\n")
    return 0


def first_publication(published_steps: list[int], notices: dict[int, WeightsNotice],
                      step: int) -> WeightsNotice | None:
    """The notice of the first weights that hold what ``step`` trained: that step's own with
    ``trainer.publish_every`` 1, a later step's otherwise; None when no later step published."""
    at = bisect.bisect_left(published_steps, step)
    return notices[published_steps[at]] if at < len(published_steps) else None


def learner_threads(env: dict[str, str]) -> int:
    """torch's thread count in a process started as the learner is (the learner sets none itself)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


History = dict[str, dict[int, float]]
"""The learner's MLflow metrics: name -> step -> value."""
PHASE_FIGURES = 9
"""Columns of a phase's row after its name and step count."""


def phase(history: History, step_numbers: list[int]) -> dict[str, float] | None:
    """The figures of the learner's steps ``step_numbers``; None when there are none (every rollout of the
    phase trained in steps shared with the other phase, or none trained): their rates divided by zero
    and the benchmark died after the whole run, with no report."""
    if not step_numbers:
        return None
    cycle = [history["num_rollouts"][s] / history["rollouts_per_s"][s] for s in step_numbers]
    waited = [history["data_wait_share"][s] * c for s, c in zip(step_numbers, cycle)]
    rollouts = sum(history["num_rollouts"][s] for s in step_numbers)
    tokens = sum(history["num_action_tokens"][s] for s in step_numbers)
    return {
        "steps": len(step_numbers),
        "rollouts": rollouts,
        "tokens": tokens,
        "seconds": sum(cycle),
        "rollouts_per_s": rollouts / sum(cycle),
        "tokens_per_s": tokens / sum(cycle),
        "wait_share": sum(waited) / sum(cycle),
        "step_p50": statistics.median(history["step_time_s"][s] for s in step_numbers),
        "publish_p50": statistics.median(history["publish_time_s"][s] for s in step_numbers),
        "checkpoint_p50": statistics.median(history["checkpoint_time_s"][s] for s in step_numbers),
        "write_p50": statistics.median(history["checkpoint_write_s"][s] for s in step_numbers),
    }


def phase_row(name: str, p: dict[str, float] | None) -> str:
    """The report's table row of a phase (:func:`phase`); n/a figures for a phase with no steps."""
    if p is None:
        return f"| {name} | 0 |" + " n/a |" * PHASE_FIGURES
    return (f"| {name} | {p['steps']} | {p['rollouts']:.0f} | {p['tokens']:.0f} | {p['rollouts_per_s']:.2f} | "
            f"{p['tokens_per_s']:.1f} | {100 * p['wait_share']:.1f}% | {p['step_p50']:.3f} | "
            f"{p['publish_p50']:.3f} | {p['checkpoint_p50']:.3f} | {p['write_p50']:.3f} |")


def analyse(args, argv, cfg, model_dir, ledger, backlog_ids, traffic, swaps, live_s, load_before, backend,
            learner_env) -> list[str]:
    steps: dict[int, list[str]] = {}
    for step, iid in read_ledger(ledger):
        steps.setdefault(step, []).append(iid)
    consumer = backend.consumer([cfg.kafka.topics.weights], group_id=None, start="earliest")
    notices: dict[int, WeightsNotice] = {}  # step -> the notice of the weights that step published
    for _ in range(10):
        for msg in consumer.poll(timeout_s=1.0):
            notice = decode(msg.value, WeightsNotice)
            if notice.action == "publish":  # not a rollback, champion or hold notice
                notices[notice.step] = notice
    consumer.close()

    client = MlflowClient(tracking_uri=cfg.mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])
    history: History = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
                        for name in ("num_rollouts", "num_action_tokens", "step_time_s", "publish_time_s",
                                     "checkpoint_time_s", "checkpoint_write_s", "data_wait_share", "rollouts_per_s",
                                     "tokens_per_s")}

    backlog_steps = sorted(s for s, ids in steps.items() if set(ids) <= backlog_ids)
    live_steps = sorted(s for s, ids in steps.items() if not set(ids) & backlog_ids)
    mixed_steps = len(steps) - len(backlog_steps) - len(live_steps)
    step_of = {iid: s for s, ids in steps.items() for iid in ids}
    to_publish, to_serve = [], []
    untrained = sorted(set(traffic.rewarded_at) - set(step_of))
    published_steps = sorted(notices)
    for iid in set(traffic.rewarded_at) - backlog_ids - set(untrained):
        notice = first_publication(published_steps, notices, step_of[iid])
        if notice is None:  # trained by a step after the last publication
            continue
        to_publish.append(notice.created_at - traffic.rewarded_at[iid])
        served = [t for v, t in swaps.items() if v >= notice.version]
        if served:
            to_serve.append(min(served) - traffic.rewarded_at[iid])
    b, live = phase(history, backlog_steps), phase(history, live_steps)
    mc = AutoConfig.from_pretrained(model_dir)

    def dist(values):
        return (f"{percentile(values, 0.5):.2f} | {percentile(values, 0.9):.2f} | {max(values):.2f} | {len(values)}"
                if values else "n/a | n/a | n/a | 0")

    t = cfg.trainer
    command = shlex.join([".venv/bin/python", "benchmarks/bench_learner.py", *(argv or sys.argv[1:])])
    return [
        "# Learner throughput and freshness (CPU)",
        "",
        f"- command: `{command}`",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} logical CPUs (shared; 1-min load "
        f"average {load_before:.1f} at start), torch {torch.__version__}, {learner_threads(learner_env)} torch threads in the learner",
        f"- model: default model ({mc.model_type}, hidden {mc.hidden_size}, {mc.num_hidden_layers} layers, "
        f"vocab {mc.vocab_size}); algorithm {cfg.algorithm.name}, K = {cfg.algorithm.critic_updates}",
        f"- learner: its own process; min_rollouts {t.min_rollouts}, max_wait_s {t.max_wait_s}, "
        f"token_budget {t.token_budget}, "
        f"max_rollouts_per_step {t.max_rollouts_per_step}, publish every {t.publish_every} step(s), "
        f"checkpoint every {t.checkpoint_every} step(s) "
        f"{'in the background' if t.checkpoint_in_background else 'before the next step'}, "
        f"MLflow on SQLite; "
        f"serving: TorchEngine + WeightsFollower in the benchmark process; broker: local single node",
        f"- traffic: {args.backlog} backlog interactions, then {len(traffic.rewarded_at) - args.backlog} live ones "
        f"over {live_s:.0f} s (at most {args.rate}/s, one at a time, up to {args.max_new_tokens} new tokens each); "
        f"not trained: {len(untrained)} (read after their reward window closed, or empty answers); "
        f"steps that trained backlog and live rollouts together (counted in neither phase): {mixed_steps}",
        "",
        "| phase | steps | rollouts | action tokens | rollouts/s | tokens/s | waiting for data | step s (p50) | "
        "publish s (p50) | checkpoint s (p50) | checkpoint write s (p50) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        phase_row("backlog (capacity)", b),
        phase_row("live", live),
        "",
        "Freshness of live rewards, seconds from the reward being acknowledged by the broker:",
        "",
        "| to | p50 | p90 | max | rewards |",
        "|---|---:|---:|---:|---:|",
        f"| weights trained on it published | {dist(to_publish)} |",
        f"| serving switched to those weights | {dist(to_serve)} |",
        "",
        "Target (issue 17): p50 under 1 s to serving on a quiet machine. Rates are per cycle: waiting for data + training + publishing + "
        "checkpointing (MLflow logging between cycles is not counted). *checkpoint s*: what the learner's loop spends "
        "on a checkpoint (in the background: copying the state and waiting for the previous write, if any); "
        "*checkpoint write s*: the write itself (on its own thread in the background).",
    ]


if __name__ == "__main__":
    sys.exit(main())
