"""Added request latency of write-ahead interaction logging (issue #7).

``serving.log_durability: write_ahead`` answers a request only after its
interaction is fsynced in the spool; ``memory`` answers at once. Two measurements:

1. logger level: ``threads`` client threads each submit a representative
   interaction and wait for its receipt (closed loop), for ``--seconds`` per
   concurrency: the latency from ``submit`` to durable (memory mode: zero by
   construction) and how many records share one fsync (group commit);
2. request level: the real app (:func:`serving.app.build_app`) on uvicorn with an
   engine that answers instantly (a fixed 16-token answer, so the model's compute
   does not drown the difference) and an in-memory broker, one server per mode;
   rounds alternate the modes; the client measures non-streaming chat requests.

The spool lives in a temporary directory under ``data/`` (the default spool's
disk). Results go to ``benchmarks/results/write_ahead.md``.

    .venv/bin/python benchmarks/bench_write_ahead.py [--seconds 5] [--rounds 6] [--requests 40]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from apps.default_model.builder import build_base_model
from apps.config import AppConfig, load_app_config
from apps.load.stats import percentile
from online_sao.modeling import load_tokenizer
from online_sao.schemas import Interaction
from serving.app import build_app
from serving.engine.base import GenerationRequest, SwapResult, TokenEvent
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from serving.server import BackgroundServer
from streams.memory import InMemoryBackend

REPO = Path(__file__).resolve().parents[1]
MODES = ("memory", "write_ahead")
ANSWER = "A short fixed answer of about sixteen tokens, enough to look like a reply."


class InstantEngine:
    """Implements ``InferenceEngine`` with no compute: every request gets ``script``."""

    def __init__(self, script: list[int]):
        self.script = script
        self.policy_version = 0

    async def generate(self, request: GenerationRequest):
        for i, token in enumerate(self.script):
            last = i + 1 == len(self.script) or i + 1 == request.sampling.max_tokens
            yield TokenEvent(token, -1.0, 0, "stop" if last else None)
            if last:
                return

    def swap_weights(self, version, state_dict, force=False) -> SwapResult:
        return SwapResult(version, False, 0.0, 0.0)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def broker(cfg: AppConfig) -> InMemoryBackend:
    """An in-memory broker with the topics created (it acknowledges at once)."""
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    return backend


def sample_record(i: int) -> Interaction:
    """About the size of a real chat interaction of the default model (60 prompt, 32 answer tokens, texts)."""
    return Interaction(interaction_id=f"sao-bench-{i:012d}", model="online-sao", prompt_ids=[7] * 60,
                       response_ids=[9] * 32, action_mask=[True] * 32, logprobs=[-1.2345678] * 32, versions=[0] * 32,
                       turn_ends=[31], prompt_text="a prompt of some sixty tokens " * 8, response_text="word " * 32)


def logger_level(cfg: AppConfig, workdir: Path, threads: int, seconds: float) -> tuple[list[float], int, int]:
    """(submit -> durable seconds of each record, records, fsyncs) of a closed loop with ``threads`` clients."""
    logger = InteractionLogger(broker(cfg).producer(), cfg.kafka.topics, workdir / f"spool-{threads}")
    logger.start()
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(k: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            if not logger.submit(sample_record(k * 10**6 + i)).wait(30):
                raise RuntimeError("a record was not durable within 30 s")
            with lock:
                latencies.append(time.perf_counter() - start)
            i += 1

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(client, range(threads)))
    logger.close(10)
    return latencies, len(latencies), logger.mode.fsyncs


def server(cfg: AppConfig, tokenizer, mode: str, workdir: Path) -> BackgroundServer:
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"log_durability": mode})})
    script = list(tokenizer(ANSWER, add_special_tokens=False)["input_ids"])[:15] + [tokenizer.eos_token_id]
    logger = InteractionLogger(broker(cfg).producer(), cfg.kafka.topics, workdir / f"spool-{mode}",
                               LogSettings(durability=mode))
    app = build_app(InstantEngine(script), logger, cfg, tokenizer, ServingMetrics(CollectorRegistry()),
                    stop_token_ids=frozenset({tokenizer.eos_token_id}), max_model_len=512)
    return BackgroundServer(app).start()


def run_round(url: str, requests: int, concurrency: int) -> list[float]:
    with httpx.Client(base_url=url, timeout=60) as client:
        def one(i: int) -> float:
            body = {"model": "online-sao", "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": 16}
            start = time.perf_counter()
            client.post("/v1/chat/completions", json=body).raise_for_status()
            return time.perf_counter() - start

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, range(requests)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="logger level: seconds per concurrency")
    p.add_argument("--threads", default="1,4,16", help="logger level: client threads")
    p.add_argument("--rounds", type=int, default=6, help="request level: rounds per mode")
    p.add_argument("--requests", type=int, default=40, help="request level: requests per round")
    p.add_argument("--concurrency", default="1,4", help="request level: concurrent clients")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "write_ahead.md"))
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    cfg = load_app_config(overrides={"serving.rate_limit_per_minute": 10**7, "serving.rate_limit_burst": 10**6})
    tokenizer = load_tokenizer(build_base_model(cfg))
    (REPO / "data").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO / "data", prefix="bench-wal-") as tmp:
        workdir = Path(tmp)
        level = {int(t): logger_level(cfg, workdir, int(t), args.seconds) for t in args.threads.split(",")}
        servers = {mode: server(cfg, tokenizer, mode, workdir) for mode in MODES}
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        results: dict[tuple[str, int], list[float]] = {(m, c): [] for m in MODES for c in concurrencies}
        try:
            for c in concurrencies:
                run_round(servers["memory"].url, 10, c)  # warm-up, not counted
                run_round(servers["write_ahead"].url, 10, c)
                for r in range(args.rounds):
                    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                        results[(mode, c)] += run_round(servers[mode].url, args.requests, c)
        finally:
            for s in servers.values():
                s.stop()
    lines = report(argv, level, results, concurrencies, load_before)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def report(argv, level, results, concurrencies, load_before) -> list[str]:
    cmd = "python benchmarks/bench_write_ahead.py" + (" " + shlex.join(argv) if argv else "")
    lines = ["# Write-ahead interaction logging: added latency (CPU box)", "",
             f"- command: `{cmd}`",
             f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs (shared with other work; 1-min load "
             f"average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at the end), spool on "
             f"{REPO / 'data'} (ext4, virtual disk)",
             f"- measured: {time.strftime('%Y-%m-%d %H:%M')}; percentiles linear between the two closest ranks",
             "",
             "## Logger level: submit -> durable (fsynced in the spool)", "",
             "| client threads | records | fsyncs | records per fsync | p50 ms | p99 ms | mean ms |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for threads, (lat, records, fsyncs) in level.items():
        ms = [x * 1000 for x in lat]
        lines.append(f"| {threads} | {records} | {fsyncs} | {records / max(fsyncs, 1):.1f} | "
                     f"{percentile(ms, 50):.2f} | {percentile(ms, 99):.2f} | {statistics.mean(ms):.2f} |")
    lines += ["", "memory mode: 0 by construction (the receipt is durable when submit returns).", "",
              "## Request level: non-streaming chat, instant engine, in-memory broker", "",
              "| concurrency | durability | requests | p50 ms | p99 ms | mean ms |", "|---:|---|---:|---:|---:|---:|"]
    for c in concurrencies:
        for mode in MODES:
            ms = [x * 1000 for x in results[(mode, c)]]
            lines.append(f"| {c} | {mode} | {len(ms)} | {percentile(ms, 50):.2f} | {percentile(ms, 99):.2f} | "
                         f"{statistics.mean(ms):.2f} |")
    lines.append("")
    for c in concurrencies:
        wal, mem = results[("write_ahead", c)], results[("memory", c)]
        lines.append(f"- concurrency {c}: write_ahead adds {1000 * (percentile(wal, 50) - percentile(mem, 50)):+.2f} "
                     f"ms at p50, {1000 * (percentile(wal, 99) - percentile(mem, 99)):+.2f} ms at p99")
    lines += ["", "What is added is the wait for the spool's fsync (a request arriving during an fsync waits for "
              "it and then for its own, shared with everything that arrived meanwhile). Against a real model "
              "the same milliseconds add to the generation time (see serving.md for the default model's request "
              "latency on this machine). fsync times of this shared virtual disk vary from run to run."]
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
