"""Pieces several benchmarks share: a throwaway local broker and the default-size model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from apps.config import AppConfig, BaseModelConfig, load_app_config
from apps.stack import free_port
from online_sao.config import KafkaConfig

REPO = Path(__file__).resolve().parents[1]


def start_broker(cfg: AppConfig, workdir: Path):
    """A local broker on free ports with its data under ``workdir``; returns it and its KafkaConfig."""
    from streams.broker import LocalBroker

    ports = {"kafka.port": free_port(), "kafka.controller_port": free_port()}
    broker_cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(workdir / "broker"), **ports})
    broker = LocalBroker(broker_cfg, lib_dir=REPO / "data" / "kafka" / f"lib-{cfg.kafka.kafka_version}",
                         stop_with_parent=True)
    broker.start()
    kafka: KafkaConfig = broker_cfg.kafka
    return broker, kafka


def random_default_model(base: BaseModelConfig) -> torch.nn.Module:
    """The default model's architecture and sizes with random weights (seed 0), for when it is not built."""
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[base.architecture]
    config = config_class(vocab_size=base.vocab_size, hidden_size=base.hidden_size,
                          intermediate_size=base.intermediate_size, num_hidden_layers=base.num_layers,
                          num_attention_heads=base.num_heads, num_key_value_heads=base.num_kv_heads,
                          max_position_embeddings=base.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    return model_class(config)


def write_report(path: Path, lines: list[str]) -> None:
    """Write a benchmark's Markdown report to ``path`` (creating its directory) and print it."""
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
