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
