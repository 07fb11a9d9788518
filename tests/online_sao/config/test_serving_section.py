"""The serving section's own checks (online_sao/config/serving.py)."""

import pytest

from online_sao.config import ConfigError, load_config


def serving(**values):
    return load_config(environ={}, overrides={f"serving.{key}": value for key, value in values.items()}).serving


def test_the_vllm_memory_share_is_a_share_of_memory_for_the_vllm_engine():
    assert serving(engine="vllm", vllm_memory_share=0.3).vllm_memory_share == 0.3
    assert serving(engine="vllm").vllm_memory_share is None  # vLLM's own default
    for share in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="vllm_memory_share"):
            serving(engine="vllm", vllm_memory_share=share)
    with pytest.raises(ConfigError, match="applies to the vLLM engine"):
        serving(engine="torch", vllm_memory_share=0.3)
