"""``online-sao kafka up|down|status``: the local broker (streams/broker.py) or the configured
cluster, as an operator asks for it. Each function prints what happened and returns an exit code.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from online_sao.config import Config
from streams.base import StreamUnavailable
from streams.broker import BrokerError, BrokerStatus, LocalBroker
from streams.kafka_backend import KafkaBackend


def _fail(err: Exception, out: TextIO) -> int:
    print(f"error: {err}", file=out)
    detail = getattr(err, "detail", "")
    if detail:
        print("---- last lines of the broker log ----", file=out)
        print(detail, file=out)
    return 1


def kafka_up(cfg: Config, out: TextIO | None = None) -> int:
    """``online-sao kafka up``: start the local broker (or use the configured cluster), ensure topics."""
    out = out or sys.stdout
    err = sys.stderr if out is sys.stdout else out
    try:
        if not cfg.kafka.is_local:
            print(f"kafka.bootstrap_servers is set: using the cluster at {cfg.kafka.bootstrap}; "
                  f"no local broker started", file=out)
            _topics_ready(cfg, KafkaBackend(cfg.kafka).ensure_topics(), out)
            return 0
        broker = LocalBroker(cfg)
        started_at = time.monotonic()
        if broker.start():
            print(f"Kafka {cfg.kafka.kafka_version} broker started in {time.monotonic() - started_at:.1f} s "
                  f"(pid {broker.pid()})", file=out)
        else:
            print(f"Kafka broker already running (pid {broker.pid()})", file=out)
        warnings = KafkaBackend(cfg.kafka).ensure_topics()
        print(f"bootstrap: {cfg.kafka.bootstrap}", file=out)
        print(f"log: {broker.log_file}", file=out)
        _topics_ready(cfg, warnings, out)
        return 0
    except (BrokerError, StreamUnavailable) as exc:
        return _fail(exc, err)


def _topics_ready(cfg: Config, warnings: list[str], out: TextIO) -> None:
    """Say the topics are there, and which of them keep another partition count than configured."""
    print(f"topics ready: {', '.join(_topic_names(cfg))}", file=out)
    for warning in warnings:  # logged too; here as well, as "topics ready" alone said all was as configured
        print(f"warning: {warning}", file=out)


def kafka_down(cfg: Config, out: TextIO | None = None) -> int:
    """``online-sao kafka down``: stop the local broker cleanly."""
    out = out or sys.stdout
    err = sys.stderr if out is sys.stdout else out
    if not cfg.kafka.is_local:
        print(f"kafka.bootstrap_servers is set ({cfg.kafka.bootstrap}): no local broker to stop", file=out)
        return 0
    broker = LocalBroker(cfg)
    try:
        stopped = broker.stop()
    except BrokerError as exc:
        return _fail(exc, err)
    print("Kafka broker stopped" if stopped else "Kafka broker is not running", file=out)
    return 0


def kafka_status(cfg: Config, out: TextIO | None = None) -> int:
    """``online-sao kafka status``: running or not, bootstrap address, topics. Exit 0 only when running."""
    out = out or sys.stdout
    try:
        if cfg.kafka.is_local:
            st = LocalBroker(cfg).status()
        else:
            topics = KafkaBackend(cfg.kafka).describe_topics()
            st = BrokerStatus(running=True, bootstrap=cfg.kafka.bootstrap, local=False, topics=topics)
    except StreamUnavailable as exc:
        print(f"Kafka cluster at {cfg.kafka.bootstrap} is not reachable: {exc}", file=out)
        return 1
    where = f"local broker (pid {st.pid})" if st.local else "external cluster"
    print(f"Kafka: {'running' if st.running else 'not running'}"
          + (f", {where}" if st.running else ""), file=out)
    print(f"bootstrap: {st.bootstrap}", file=out)
    if st.log_file is not None:
        print(f"log: {st.log_file}", file=out)
    if st.running:
        print("topics:" if st.topics else "topics: (none)", file=out)
        for name, partitions in sorted(st.topics.items()):
            print(f"  {name}  partitions={partitions}", file=out)
    return 0 if st.running else 1


def _topic_names(cfg: Config) -> list[str]:
    t = cfg.kafka.topics
    return [t.interactions, t.rewards, t.weights, t.dead_letters]
