"""The model directory a registry version copies (trainer/registry_versions.py)."""

from __future__ import annotations

import hashlib

from online_sao.weights import WeightsRef
from trainer.registry_versions import stage_model_directory


def test_a_version_of_a_sharded_base_model_holds_the_published_weights_and_no_shard_index(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "pytorch_model-00001-of-00002.bin"):
        (base / name).write_bytes(b"a shard of the base weights")
    index = '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}'
    (base / "model.safetensors.index.json").write_text(index)
    (base / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        (base / name).write_text(f"the base model's {name}")
    published = tmp_path / "v3.safetensors"
    published.write_bytes(b"the published weights of version 3")
    ref = WeightsRef(3, str(published), hashlib.sha256(published.read_bytes()).hexdigest())
    staged = tmp_path / "staged"
    staged.mkdir()

    stage_model_directory(ref, base, staged)

    assert sorted(p.name for p in staged.iterdir()) == ["chat_template.jinja", "config.json",
                                                         "generation_config.json", "model.safetensors",
                                                         "tokenizer.json"]
    assert (staged / "model.safetensors").read_bytes() == b"the published weights of version 3"
    assert (staged / "config.json").read_text() == "the base model's config.json"
