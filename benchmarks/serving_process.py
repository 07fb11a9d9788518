"""The serving process of ``bench_serving``: the ``online-sao serve`` stack whose Kafka logging the
benchmark switches off and on between rounds.

The server runs in a process of its own, as in production (``online-sao serve``),
so that the client and the broker do not share its interpreter lock. It is the
production wiring (engine, app, interaction logger with its spool and Kafka
producer); ``POST /bench/logging?on=false`` makes the logger drop every record
before it is encoded (its threads stay, idle) and ``on=true`` brings it back, so
both modes run in the same process with the same engine and nothing else differs.
Switching off first waits until everything logged so far is acknowledged.

    python -m benchmarks.serving_process --spool-dir DIR [--bootstrap HOST:PORT] [--backend kafka|memory]
        [--config FILE] [--threads 1]

Prints ``URL <url>`` once it serves and serves until its stdin closes; then it
stops like ``online-sao serve`` (open requests finish, the log is flushed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry
from transformers import AutoConfig

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.default_model.builder import build_base_model  # noqa: E402
from apps.config import AppConfig, load_app_config  # noqa: E402
from online_sao.modeling import load_tokenizer  # noqa: E402
from online_sao.schemas import Interaction, Reward  # noqa: E402
from serving.app import build_app  # noqa: E402
from serving.interaction_log import InteractionLogger  # noqa: E402
from serving.metrics import ServingMetrics  # noqa: E402
from serving.receipt import Receipt  # noqa: E402
from serving.server import BackgroundServer, LazyProducer, make_engine, make_logger, stop_token_ids  # noqa: E402
from streams.kafka_backend import KafkaBackend  # noqa: E402
from streams.memory import InMemoryBackend  # noqa: E402

SWITCH_FLUSH_S = 60.0
"""How long switching logging off waits for what was logged so far to be acknowledged."""


class SwitchableLogging:
    """The production logger, except that ``submit`` drops records (before encoding) while off."""

    def __init__(self, logger: InteractionLogger):
        self._logger = logger
        self.on = True

    def submit(self, record: Interaction | Reward) -> Receipt:
        return self._logger.submit(record) if self.on else Receipt(durable=True)

    def __getattr__(self, name: str):
        return getattr(self._logger, name)


def build(cfg: AppConfig, model_dir: Path, backend_kind: str):
    """The app of ``online-sao serve`` (without a weights follower) over a switchable logger."""
    backend = KafkaBackend(cfg.kafka) if backend_kind == "kafka" else InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    tokenizer = load_tokenizer(model_dir)
    producer = LazyProducer(backend)
    logging = SwitchableLogging(make_logger(cfg, producer))
    app = build_app(make_engine(cfg, model_dir, tokenizer), logging, cfg, tokenizer,
                    ServingMetrics(CollectorRegistry()), stop_token_ids=stop_token_ids(model_dir, tokenizer),
                    max_model_len=AutoConfig.from_pretrained(model_dir).max_position_embeddings)

    @app.post("/bench/logging")
    def switch(on: bool) -> dict:
        if not on and logging.on and not logging.flush(SWITCH_FLUSH_S):
            raise RuntimeError(f"the log was not acknowledged within {SWITCH_FLUSH_S} s")
        logging.on = on
        return {"on": on}

    return app, producer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool-dir", required=True)
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: the config's)")
    p.add_argument("--backend", choices=["kafka", "memory"], default="kafka",
                   help="memory: log through the full logger into an in-process stream (no Kafka client)")
    p.add_argument("--config", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {"serving.spool_dir": args.spool_dir,
                 # the benchmark measures latency, not the per-key limiter
                 "serving.rate_limit_per_minute": 1_000_000, "serving.rate_limit_burst": 10_000}
    if args.bootstrap:
        overrides["kafka.bootstrap_servers"] = args.bootstrap
    cfg = load_app_config(args.config, overrides=overrides)
    model_dir = build_base_model(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    app, producer = build(cfg, model_dir, args.backend)
    server = BackgroundServer(app, keep_alive_s=cfg.serving.keep_alive_s).start()
    print(f"URL {server.url}", flush=True)
    sys.stdin.read()  # serve until the benchmark closes our stdin
    server.stop()
    producer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
