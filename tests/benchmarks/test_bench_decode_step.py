"""The decode-step benchmark measures full-batch rounds only, and says when there are too few."""

from __future__ import annotations

import statistics
from itertools import takewhile

import pytest

from benchmarks import bench_decode_step
from benchmarks.bench_decode_step import WARMUP_ROUNDS, one_run
from online_sao.modeling import load_policy
from serving.engine.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


@pytest.fixture
def steps(monkeypatch):
    """Every step the benchmark's engine runs, recorded beside the benchmark's own hook."""
    recorded = []

    class Recording(TorchEngine):
        def __init__(self, *args, on_step, **kwargs):
            super().__init__(*args, on_step=lambda s: (recorded.append(s), on_step(s)), **kwargs)

    monkeypatch.setattr(bench_decode_step, "TorchEngine", Recording)
    return recorded


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_run_reports_the_cpu_and_wall_time_of_a_full_batch_round(model, top_p, steps):
    cpu_s, wall_s = one_run(model, batch=3, new_tokens=30, top_p=top_p, seed=0)
    kinds = [(s.kind, s.batch_size) for s in steps]
    first = kinds.index(("decode", 3))
    full = steps[first:first + len(list(takewhile(lambda k: k == ("decode", 3), kinds[first:])))]
    # 30 tokens each, the first from the prefill: 29 full rounds when the three start in one round
    # (the engine may take the first request a round before the others: a few fewer)
    assert 20 <= len(full) <= 29
    # the wall time is the median gap between full rounds after the warm-up ones, not a whole run's
    ends = [s.ended_at for s in full][WARMUP_ROUNDS:]
    assert wall_s == statistics.median(b - a for a, b in zip(ends, ends[1:]))
    assert cpu_s > 0


def test_too_few_full_rounds_are_refused(model):
    with pytest.raises(RuntimeError, match="full-batch rounds"):
        one_run(model, batch=3, new_tokens=8, top_p=1.0, seed=0)
