"""The serving benchmark's count of logged interactions and its header, against fake servers (no
model, no broker): the Kafka check compares what the servers logged with what the benchmark sent."""

from __future__ import annotations

import re
from types import SimpleNamespace

from benchmarks import bench_serving


class FakeServers:
    """Server processes that answer at once and count the requests they log (logging on at start)."""

    def __init__(self) -> None:
        self.mode = "on"
        self.logged = 0

    def start_server(self, spool_dir, args, bootstrap):
        self.mode = "on"  # a fresh process logs
        return SimpleNamespace(), "http://fake"

    def set_logging(self, url: str, mode: str) -> None:
        self.mode = mode

    def run_round(self, url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[tuple[float, int]]:
        if self.mode == "on":
            self.logged += len(prompts)
        return [(0.01, 4) for _ in prompts]

    def count_on_topic(self, backend, topic: str, expected: int, timeout_s: float = 60.0) -> int:
        return self.logged


class NoKafka:
    def __init__(self, config) -> None:
        pass

    def ensure_topics(self) -> None:
        pass


def _run(monkeypatch, tmp_path, *args: str) -> tuple[FakeServers, str]:
    fake = FakeServers()
    for name in ("start_server", "set_logging", "run_round", "count_on_topic"):
        monkeypatch.setattr(bench_serving, name, getattr(fake, name))
    monkeypatch.setattr(bench_serving, "stop_server", lambda proc: None)
    monkeypatch.setattr(bench_serving, "sample_record", lambda url, prompt, max_tokens: None)
    monkeypatch.setattr(bench_serving, "logging_cpu_ms", lambda *a, **k: (0.1, None))
    monkeypatch.setattr(bench_serving, "build_base_model", lambda cfg, progress: tmp_path / "model")
    monkeypatch.setattr(bench_serving, "KafkaBackend", NoKafka)
    out = tmp_path / "serving.md"
    assert bench_serving.main([*args, "--bootstrap", "fake:9092", "--out", str(out)]) == 0
    return fake, out.read_text()


def test_fewer_requests_than_the_warm_up_loses_nothing_in_the_kafka_check(monkeypatch, tmp_path):
    """--requests 2: the warm-up sent 2 requests but counted 4, and the check reported 2 of the
    interactions sent as lost."""
    fake, text = _run(monkeypatch, tmp_path, "--requests", "2", "--trials", "2", "--rounds", "2",
                      "--concurrency", "1")
    checked = re.search(r"Kafka check: (\d+) of (\d+) interactions", text)
    assert checked and checked.group(1) == checked.group(2) == str(fake.logged), checked


def test_the_header_reports_the_requests_a_round_sent(monkeypatch, tmp_path):
    """A round at concurrency 4 sends at least 16 requests whatever --requests says; the header said 2."""
    _, text = _run(monkeypatch, tmp_path, "--requests", "2", "--trials", "1", "--rounds", "2",
                   "--concurrency", "1,4")
    assert "(4 at concurrency 1, 16 at concurrency 4: --requests 2" in text
    rows = {line.split("|")[1].strip() + line.split("|")[2].strip(): int(line.split("|")[3])
            for line in text.splitlines() if re.match(r"\| \d+ \| (on|off) \|", line)}
    assert rows == {"1on": 2 * 4, "1off": 2 * 4, "4on": 2 * 16, "4off": 2 * 16}  # rounds x requests of a round
