"""Request latency of the serving endpoint with Kafka logging on and off (issue 4, performance).

Each trial starts a fresh server process (:mod:`benchmarks.serving_process`):
the stack of ``online-sao serve`` with a TorchEngine over the default model
(built under the configured data dir if it is not there yet), logging every
interaction write-ahead (spool, fsync) and to a real Kafka broker (a local one
started in a temporary directory unless ``--bootstrap`` names one). Rounds
switch its logging between

* ``off``: the logger's ``submit`` drops the record before it is encoded (its threads stay, idle);
* ``on``: the production path,

in alternating order, so both modes run in the same process with the same engine
and the noise of a shared machine falls on both alike; fresh processes per trial
average out one process's luck (memory layout, which core it lands on). Request
``i`` of every round and mode uses the same prompt and seed, so both modes sample
the same tokens. Latency is measured by the client from sending a non-streaming
chat request to the complete answer. At the end the topic is read back to show
that every interaction logged arrived, and the CPU one logged record costs is
measured apart from the engine (the process's and the broker's).

    .venv/bin/python benchmarks/bench_serving.py [--trials 5] [--rounds 24] [--requests 8] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

if __package__ in (None, ""):  # run as a file: make the repository's `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import start_broker  # noqa: E402
from apps.default_model.builder import build_base_model
from apps.config import AppConfig, load_app_config
from online_sao.config import KafkaConfig
from apps.default_model.corpus import iter_prompts
from online_sao.schemas import Interaction
from serving.interaction_log import InteractionLogger, LogSettings
from streams.kafka_backend import KafkaBackend

REPO = Path(__file__).resolve().parents[1]
MODES = ("off", "on")
WARM_UP_REQUESTS = 4
"""Requests each server answers before the rounds (the first calls pay one-off costs); logged, not timed."""


def start_server(spool_dir: Path, args, bootstrap: str | None) -> tuple[subprocess.Popen, str]:
    """A serving process; returns it and its URL once it answers."""
    cmd = [sys.executable, "-m", "benchmarks.serving_process", "--spool-dir", str(spool_dir),
           "--threads", str(args.threads), "--backend", args.on_backend]
    cmd += ["--bootstrap", bootstrap] if bootstrap else []
    cmd += ["--config", args.config] if args.config else []
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("URL "):
            return proc, line.split()[1]
    raise RuntimeError(f"the server exited with {proc.wait()} before serving (its log is above)")


def set_logging(url: str, mode: str) -> None:
    httpx.post(f"{url}/bench/logging", params={"on": mode == "on"}, timeout=120).raise_for_status()


def stop_server(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Close its stdin: it stops like ``online-sao serve`` (open requests finish, the log is flushed)."""
    proc.stdin.close()
    if proc.wait(timeout_s) != 0:
        raise RuntimeError(f"a serving process exited with {proc.returncode}")


def run_round(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[tuple[float, int]]:
    """(seconds, completion tokens) of each request."""
    with httpx.Client(base_url=url, timeout=300) as client:
        def one(i: int) -> tuple[float, int]:
            body = {"model": "online-sao", "messages": [{"role": "user", "content": prompts[i]}],
                    "max_tokens": max_tokens, "temperature": 1.0, "seed": i}
            start = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - start
            r.raise_for_status()
            return elapsed, r.json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, range(len(prompts))))


def sample_record(url: str, prompt: str, max_tokens: int) -> Interaction:
    """A representative interaction: one request's token counts, with text."""
    body = {"model": "online-sao", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "seed": 0}
    usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()["usage"]
    n = usage["completion_tokens"]
    return Interaction(interaction_id="sao-" + "0" * 100, model="online-sao",
                       prompt_ids=[7] * usage["prompt_tokens"], response_ids=[9] * n, action_mask=[True] * n,
                       logprobs=[-1.2345678] * n, versions=[0] * n, turn_ends=[n - 1], prompt_text=prompt * 2,
                       response_text="word " * n)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def logging_cpu_ms(cfg: AppConfig, kafka: KafkaConfig, spool_dir: Path, record: Interaction, ship_interval_s: float,
                   broker_pid: int | None, count: int = 400, rate_hz: float = 40.0) -> tuple[float, float | None]:
    """(process, broker) CPU milliseconds per record through a live write-ahead logger to Kafka, records
    submitted one by one at ``rate_hz`` (each waits for its receipt, as a request does), no engine running.
    The process figure includes building each record copy, as the request path does."""
    s = cfg.serving
    settings = LogSettings(window=s.log_window, stall_s=s.log_stall_s, retry_s=s.log_retry_s,
                           ship_interval_s=ship_interval_s)
    logger = InteractionLogger(KafkaBackend(kafka).producer(), kafka.topics, spool_dir, settings)
    logger.start()
    try:
        for i in range(20):  # warm-up: connection, metadata, first batch
            logger.submit(record.model_copy(update={"interaction_id": f"cpu-warm-{ship_interval_s}-{i}"})).wait(30)
        if not logger.flush(60.0):
            raise RuntimeError("the logger did not deliver the warm-up records within 60 s")
        start, broker_start = time.process_time(), cpu_seconds(broker_pid) if broker_pid else None
        for i in range(count):
            receipt = logger.submit(record.model_copy(update={"interaction_id": f"cpu-{ship_interval_s}-{i}"}))
            if not receipt.wait(30):
                raise RuntimeError("a record did not become durable within 30 s")
            time.sleep(1 / rate_hz)
        if not logger.flush(60.0):
            raise RuntimeError("the logger did not deliver the CPU probe records within 60 s")
        process_ms = (time.process_time() - start) * 1000 / count
        broker_ms = (cpu_seconds(broker_pid) - broker_start) * 1000 / count if broker_pid else None
        return process_ms, broker_ms
    finally:
        logger.close(10.0)


def count_on_topic(backend: KafkaBackend, topic: str, expected: int, timeout_s: float = 60.0) -> int:
    """Records on ``topic``: read until ``expected`` arrived, then 2 s more so extra copies would show."""
    consumer = backend.consumer([topic])
    count, deadline = 0, time.monotonic() + timeout_s
    while count < expected and time.monotonic() < deadline:
        count += len(consumer.poll(1.0, max_records=10_000))
    settle = time.monotonic() + 2.0
    while time.monotonic() < settle:
        count += len(consumer.poll(0.5, max_records=10_000))
    consumer.close()
    return count


def requests_per_round(requests: int, concurrency: int) -> int:
    """At least ``requests``, and at least 4 waves of ``concurrency`` requests: a round of only one or
    two waves is mostly its ramp-up and tail, and the noise of its few slowest requests."""
    return max(requests, 4 * concurrency)


def round_prompts(corpus: list[str], requests: int, concurrency: int) -> list[str]:
    """The prompts of a round at ``concurrency``: :func:`requests_per_round` of them, or the whole corpus
    when it holds fewer (what is sent, and counted, is this list)."""
    return corpus[:requests_per_round(requests, concurrency)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("--trials", type=int, default=5, help="fresh server processes, one after the other")
    p.add_argument("--rounds", type=int, default=24,
                   help="rounds per trial and concurrency (modes alternate); many short rounds put the two modes "
                        "close together in time, so the machine's drift cancels")
    p.add_argument("--requests", type=int, default=8, help="requests per round and mode (at least 4 x concurrency)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client concurrencies")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--bootstrap", default=None, help="an existing Kafka cluster instead of a local broker")
    p.add_argument("--on-backend", choices=["kafka", "memory"], default="kafka",
                   help="memory: the `on` server logs through the full logger (spool, sender thread) into an "
                        "in-process stream instead of kafka-python, to isolate the Kafka client's share")
    p.add_argument("--broker-nice", type=int, default=0,
                   help="niceness of the local broker (19: it takes CPU only when the servers leave some, "
                        "standing in for a broker on machines of its own, as in production)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving.md"))
    args = p.parse_args(argv)
    cfg = load_app_config(args.config)
    model_dir = build_base_model(cfg, progress=lambda line: print(line, flush=True))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    corpus = [prompt for _, _, prompt in iter_prompts()]
    warm_up = corpus[:WARM_UP_REQUESTS]
    per_round = {c: round_prompts(corpus, args.requests, c) for c in concurrencies}
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        workdir = Path(tmp)
        broker, kafka = None, cfg.kafka
        if args.bootstrap:
            kafka = cfg.kafka.model_copy(update={"bootstrap_servers": args.bootstrap})
        elif args.on_backend == "kafka":
            broker, kafka = start_broker(cfg, workdir)
            if args.broker_nice:
                pid = int(broker.pid_file.read_text())
                for task in os.listdir(f"/proc/{pid}/task"):  # every JVM thread: niceness is per thread on Linux
                    os.setpriority(os.PRIO_PROCESS, int(task), args.broker_nice)
        try:
            bootstrap = kafka.bootstrap if args.on_backend == "kafka" else None
            if bootstrap:
                KafkaBackend(kafka).ensure_topics()
            results = {(mode, c): [] for mode in MODES for c in concurrencies}
            trial_p50 = {c: [] for c in concurrencies}
            logged = 0
            for trial in range(args.trials):
                proc, url = start_server(workdir / f"spool-{trial}", args, bootstrap)
                try:
                    # counted as sent: a fixed 4 counted with --requests below 4 sent fewer, and the Kafka
                    # check reported interactions lost that were never sent
                    logged += len(run_round(url, warm_up, 1, args.max_tokens))
                    for c in concurrencies:
                        this_trial = {mode: [] for mode in MODES}
                        for r in range(args.rounds):
                            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                                set_logging(url, mode)
                                this_trial[mode] += run_round(url, per_round[c], c, args.max_tokens)
                            logged += len(per_round[c])
                            print(f"trial {trial + 1}/{args.trials} concurrency {c} round {r + 1}/{args.rounds} done",
                                  flush=True)
                        for mode in MODES:
                            results[(mode, c)] += this_trial[mode]
                        trial_p50[c].append({mode: percentile([t for t, _ in this_trial[mode]], 0.5)
                                             for mode in MODES})
                    if trial == 0:
                        set_logging(url, "off")
                        record = sample_record(url, corpus[0], args.max_tokens)
                finally:
                    stop_server(proc)
            on_topic = count_on_topic(KafkaBackend(kafka), kafka.topics.interactions, logged) if bootstrap else None
            cpu = {}
            if bootstrap:
                broker_pid = int(broker.pid_file.read_text()) if broker is not None else None
                for interval in sorted({cfg.serving.log_ship_interval_s, 0.0}, reverse=True):
                    cpu[interval] = logging_cpu_ms(cfg, kafka, workdir / f"spool-cpu-{interval}", record, interval,
                                                   broker_pid)
        finally:
            if broker is not None:
                broker.stop()

    lines = report(args, argv, cfg, model_dir, per_round, results, trial_p50, load_before)
    for interval, (process_ms, broker_ms) in cpu.items():
        broker_part = "" if broker_ms is None else f", the broker {broker_ms:.2f} ms"
        lines.append(f"- CPU per logged record with `serving.log_ship_interval_s` = {interval:g}: the serving "
                     f"process {process_ms:.2f} ms{broker_part} (records one by one at 40/s, each waiting "
                     "for its receipt; no engine running)")
    if on_topic is not None:
        lines += ["", f"Kafka check: {on_topic} of {logged} interactions logged by the server processes read back "
                      "from the topic (each server process flushed its log on its clean stop)."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def report(args, argv, cfg, model_dir, per_round: dict[int, list[str]], results, trial_p50,
           load_before) -> list[str]:
    """The report's lines; ``per_round``: the prompts of a round at each concurrency (what was sent)."""
    concurrencies = list(per_round)
    sizes = ", ".join(f"{len(prompts)} at concurrency {c}" for c, prompts in per_round.items())
    command = "python benchmarks/bench_serving.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    base = cfg.model.base
    lines = [
        "# Serving latency with Kafka logging on and off (CPU)", "",
        f"- command: `{command.strip()}`",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} logical CPUs (the broker and "
        f"the client share them; 1-min load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at the "
        f"end), torch {torch.__version__}, {args.threads} torch thread(s) per server",
        f"- model: default model from {model_dir} ({base.architecture}, hidden {base.hidden_size}, "
        f"{base.num_layers} layers, vocab {base.vocab_size})",
        f"- workload: non-streaming chat requests, max_tokens {args.max_tokens}, temperature 1.0, seeded; "
        f"{args.trials} trials (a fresh server process each) x {args.rounds} rounds x the requests of a round "
        f"per mode ({sizes}: --requests {args.requests}, at least 4 x the concurrency), after {WARM_UP_REQUESTS} "
        f"warm-up requests per server; the process's logging switched between rounds, "
        f"modes alternating; `on` logs write-ahead (`serving.log_ship_interval_s` = "
        f"{cfg.serving.log_ship_interval_s:g}) to {'Kafka' if args.on_backend == 'kafka' else 'an in-process stream'}"
        + (f"; the local broker runs at nice {args.broker_nice}" if args.broker_nice else ""),
        f"- measured: {time.strftime('%Y-%m-%d %H:%M')}", "",
        "| concurrency | logging | requests | p50 ms | p99 ms | mean ms | mean tokens |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    overheads = []
    for c in concurrencies:
        p50 = {}
        for mode in MODES:
            rows = results[(mode, c)]
            seconds = [s for s, _ in rows]
            p50[mode] = percentile(seconds, 0.5)
            lines.append(f"| {c} | {mode} | {len(rows)} | {p50[mode] * 1000:.1f} | "
                         f"{percentile(seconds, 0.99) * 1000:.1f} | {statistics.mean(seconds) * 1000:.1f} | "
                         f"{statistics.mean(t for _, t in rows):.1f} |")
        ratios = sorted(on / off for (on, _), (off, _) in zip(results[("on", c)], results[("off", c)]))
        per_trial = ", ".join(f"{100 * (t['on'] / t['off'] - 1):+.1f}%" for t in trial_p50[c])
        quartiles = [100 * (percentile(ratios, q) - 1) for q in (0.25, 0.5, 0.75)]
        overheads.append(f"concurrency {c}: p50 {100 * (p50['on'] / p50['off'] - 1):+.1f}% (per trial: "
                         f"{per_trial}); paired median {quartiles[1]:+.1f}% (interquartile "
                         f"{quartiles[0]:+.1f}% to {quartiles[2]:+.1f}%)")
    lines += ["", "Overhead of logging (target: at most +5% on p50), all trials pooled; \"paired\" compares each "
              "request with the same request (same prompt and seed, same trial and round) of the other mode:", ""]
    lines += [f"- {o}" for o in overheads] + [""]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
