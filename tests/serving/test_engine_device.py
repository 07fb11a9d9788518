"""Where ``online-sao serve``'s native engine runs (``serving.device``): it ran on the CPU on every
host, a GPU server's included, without a word."""

from __future__ import annotations

import pydantic
import pytest
import torch

from online_sao.config import ConfigError, load_config
from serving import server
from serving.server import engine_device


def sees_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_the_first_gpu_where_torch_sees_one_else_the_cpu(monkeypatch):
    sees_gpus(monkeypatch, 2)
    assert engine_device("auto") == torch.device("cuda", 0)
    sees_gpus(monkeypatch, 0)
    assert engine_device("auto") == torch.device("cpu")


def test_a_named_device_is_used_and_a_gpu_torch_does_not_see_is_refused(monkeypatch):
    sees_gpus(monkeypatch, 2)
    assert engine_device("cpu") == torch.device("cpu")
    assert engine_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"serving\.device is 'cuda:2' but torch sees 2 CUDA GPU"):
        engine_device("cuda:2")
    sees_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="sees 0 CUDA GPU"):
        engine_device("cuda")


@pytest.mark.parametrize("setting", ["gpu", "cuda:", "mps", "cuda:0,1"])
def test_a_device_the_engine_cannot_run_on_is_refused_at_load(tmp_path, setting):
    with pytest.raises((ConfigError, pydantic.ValidationError), match="serving.device"):
        load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "serving.device": setting})


def test_the_served_engines_model_is_put_on_the_configured_device(tmp_path, tiny_model_dir, monkeypatch):
    from online_sao.modeling import load_tokenizer

    asked: list[str] = []

    def record(setting: str) -> torch.device:
        asked.append(setting)
        return torch.device("cpu")  # the only device this test can count on

    moved: list[torch.device] = []
    real_to = torch.nn.Module.to

    def recording_to(module, *args, **kwargs):
        moved.extend(arg for arg in args if isinstance(arg, torch.device))
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(server, "engine_device", record)
    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "serving.device": "cuda:3"})
    server.make_engine(cfg, tiny_model_dir, load_tokenizer(tiny_model_dir))  # built, not started
    assert asked == ["cuda:3"] and torch.device("cpu") in moved


@pytest.mark.gpu
def test_on_a_gpu_host_auto_serves_from_the_gpu(tmp_path, tiny_model_dir):
    from online_sao.modeling import load_tokenizer

    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    engine = server.make_engine(cfg, tiny_model_dir, load_tokenizer(tiny_model_dir))
    assert next(engine._model.parameters()).device.type == "cuda"
