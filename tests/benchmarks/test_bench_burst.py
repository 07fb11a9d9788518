"""The burst benchmark (benchmarks/bench_burst.py) on the tiny model."""

from __future__ import annotations

import argparse

from benchmarks.bench_burst import one_burst
from online_sao.modeling import load_policy


def test_a_burst_is_prefilled_in_one_step_and_every_request_gets_its_first_token(tiny_model_dir):
    args = argparse.Namespace(burst=3, min_prompt=2, max_prompt=9)
    result = one_burst(load_policy(tiny_model_dir).eval(), args, seed=0)
    assert result["prefill_steps"] == 1 and result["requests_per_prefill"] == 3
    assert 0 < result["ttft_p50_s"] <= result["ttft_last_s"]
