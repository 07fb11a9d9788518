"""The decode-step benchmark measures full-batch rounds only, and says when there are too few."""

from __future__ import annotations

import pytest

from benchmarks.bench_decode_step import one_run
from online_sao.modeling import load_policy


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_run_reports_the_cpu_and_wall_time_of_a_full_batch_round(model, top_p):
    cpu_s, wall_s = one_run(model, batch=3, new_tokens=30, top_p=top_p, seed=0)
    assert 0 < cpu_s < 1.0 and 0 < wall_s < 1.0


def test_too_few_full_rounds_are_refused(model):
    with pytest.raises(RuntimeError, match="full-batch rounds"):
        one_run(model, batch=3, new_tokens=8, top_p=1.0, seed=0)
