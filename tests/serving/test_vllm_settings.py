"""The engine arguments the vLLM engine hands vLLM (serving/engine/vllm_settings.py): what it sets itself,
its engine seed and its memory share. Plain tests (no vLLM) but the last, which reads vLLM's default."""

from __future__ import annotations

import pytest

from serving.engine.vllm_settings import ENGINE_SEEDS, engine_args, memory_args

OWN = {"model": "/models/m", "max_num_seqs": 4, "load_format": "safetensors"}


def test_an_engine_argument_the_engine_sets_is_refused_naming_it_unless_it_is_the_engines():
    """docs/RELIABILITY.md told users to pass ``load_format="safetensors"``, which the engine sets itself:
    vLLM's constructor failed with "got multiple values for keyword argument"."""
    assert engine_args(OWN, {"load_format": "safetensors", "max_model_len": 128})["load_format"] == "safetensors"
    with pytest.raises(ValueError, match=r"max_num_seqs itself \(4: serving\.max_batch_size\), 8 was given") as refused:
        engine_args(OWN, {"max_num_seqs": 8, "load_format": "pt", "max_model_len": 128})
    assert "load_format itself ('safetensors'" in str(refused.value)
    assert "max_model_len" not in str(refused.value)


def test_without_a_seed_each_engine_draws_its_own_and_a_given_seed_is_kept():
    """vLLM's default engine seed (0) replayed every unseeded request's draws after each restart and on
    every replica."""
    seeds = {engine_args(OWN, {})["seed"] for _ in range(8)}
    assert len(seeds) > 1 and all(0 <= seed < ENGINE_SEEDS for seed in seeds)
    assert engine_args(OWN, {"seed": 7})["seed"] == 7


@pytest.mark.parametrize("share, engines, expected", [
    (None, 1, {}),
    (0.4, 1, {"gpu_memory_utilization": 0.4}),
    (0.4, 2, {"gpu_memory_utilization": 0.2}),
])
def test_the_memory_share_is_split_between_the_engines_of_the_process(share, engines, expected):
    assert memory_args(share, engines) == expected


@pytest.mark.vllm
def test_a_canary_without_a_share_splits_vllms_default():
    from vllm import EngineArgs

    assert memory_args(None, 2) == {"gpu_memory_utilization": EngineArgs.gpu_memory_utilization / 2}


def test_a_host_memory_share_that_is_not_available_is_refused_naming_the_setting_and_what_fits():
    """On CPU, 0.97 of a 24 GiB host with 12 GiB free: vLLM's worker died on a traceback that advised its
    own --gpu-memory-utilization."""
    from online_sao.config import ConfigError
    from serving.engine.vllm_settings import check_host_memory_share

    gib = 1 << 30
    with pytest.raises(ConfigError) as refused:
        check_host_memory_share(0.97, 24 * gib, 12 * gib)
    message = str(refused.value)
    assert message.startswith("serving.vllm_memory_share: ")
    assert "takes 0.97 of the host's 24.0 GiB (23.3 GiB) at start, and 12.0 GiB is available" in message
    assert "each engine's part is at most 0.50" in message


def test_a_host_memory_share_that_fits_or_memory_that_cannot_be_read_passes():
    from serving.engine.vllm_settings import check_host_memory_share

    gib = 1 << 30
    check_host_memory_share(0.5, 24 * gib, 12 * gib)  # exactly what is free
    check_host_memory_share(0.97, 24 * gib, None)  # neither /proc/meminfo nor a cgroup readable
