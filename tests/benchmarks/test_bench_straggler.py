"""The straggler benchmark: lengths, the learner's take rule, the accounting, and
both loops end to end on the tiny model (two real worker processes each)."""

from __future__ import annotations

import queue
import statistics
from types import SimpleNamespace

import pytest

from benchmarks.bench_straggler import loop_specs, parse_args, run_benchmark, untrained_loops
from benchmarks.straggler.learner import take
from benchmarks.straggler.report import (balanced_ceiling, contention_free_estimate, pair_ratios, population_mean_length,
                                         write_plot, write_report)
from benchmarks.straggler.runner import LoopResult, Mailbox
from benchmarks.straggler.spec import (EngineStep, Finished, GeneratorReport, LearnerReport, LoopSpec, StepRecord,
                                       response_length)
from online_sao.schemas import Interaction


def spec(**overrides) -> LoopSpec:
    fields = dict(mode="stream", model_dir="unused", weights_dir="unused", sigma=1.0, median_tokens=32,
                  max_tokens=256, group_size=4, groups_per_batch=4, concurrency=16, rollouts=16, duration_s=None,
                  seed=0, max_untrained=128)
    return LoopSpec(**{**fields, **overrides})


def test_lengths_are_seeded_lognormal_draws_within_the_cap():
    s = spec(max_tokens=10_000)
    draws = [response_length(s, i) for i in range(2001)]
    assert draws == [response_length(s, i) for i in range(2001)]
    assert abs(statistics.median(draws) - 32) <= 3
    assert max(draws) > 4 * 32  # sigma = 1: a heavy tail (p99 is about 10x the median)
    assert draws != [response_length(spec(max_tokens=10_000, seed=1), i) for i in range(2001)]
    capped = [response_length(spec(max_tokens=40), i) for i in range(500)]
    assert max(capped) == 40 and min(capped) >= 1
    assert {response_length(spec(sigma=0.0), i) for i in range(50)} == {32}
    assert population_mean_length(spec(sigma=0.0), draws=10) == 32
    assert population_mean_length(spec(max_tokens=40), draws=3) == pytest.approx(
        sum(response_length(spec(max_tokens=40), i) for i in range(3)) / 3)


def finished(index: int, tokens: int) -> Finished:
    interaction = Interaction(interaction_id=f"i{index}", model="m", prompt_ids=[1, 2], response_ids=[3] * tokens,
                              action_mask=[True] * tokens, logprobs=[-1.0] * tokens, versions=[0] * tokens)
    return Finished(0, index, tokens, interaction)


def test_take_stops_at_max_rollouts_or_once_the_token_budget_is_reached():
    pending = [finished(i, 10) for i in range(6)]
    assert [f.index for f in take(pending, max_rollouts=4, token_budget=1000)] == [0, 1, 2, 3]
    assert [f.index for f in pending] == [4, 5]
    pending = [finished(0, 30), finished(1, 30), finished(2, 30)]
    assert [f.index for f in take(pending, max_rollouts=32, token_budget=50)] == [0, 1]
    pending = [finished(0, 500)]
    assert len(take(pending, max_rollouts=32, token_budget=50)) == 1 and not pending


def test_accounting_clips_to_the_loop_and_weights_by_time():
    steps = [StepRecord(10.0, 12.0, (0, 1), (5, 5), 20, 14, 0.0, cpu_s=1.0, packed_slots=16),
             StepRecord(15.0, 18.0, (2,), (10,), 12, 12, 2.0, cpu_s=3.0, packed_slots=12)]
    engine = [EngineStep(8.0, 11.0, "decode", 4),  # 1 s inside the loop
              EngineStep(11.0, 12.0, "switch", 0),  # a weight switch is not decoding
              EngineStep(12.0, 14.0, "decode", 2), EngineStep(14.0, 14.5, "prefill", 1),
              EngineStep(19.0, 21.0, "decode", 8)]  # ends after the loop
    result = LoopResult(spec(), GeneratorReport(engine, {}, 0, cpu_s=5.0, wall_s=10.0),
                        LearnerReport(10.0, 20.0, steps, {0: 5, 1: 5, 2: 10}))
    assert result.trained == 3 and result.rollouts_per_s == pytest.approx(0.3)
    assert result.learner_idle_share == pytest.approx(0.5)  # 5 of 10 s in steps
    assert result.generator_idle_share == pytest.approx(1 - 4.5 / 10)  # 1 + 2 + 0.5 + 1
    assert result.mean_decode_batch == pytest.approx((4 * 1 + 2 * 2 + 8 * 1) / 4)
    assert result.prefill_share == pytest.approx(0.5 / 4.5)  # of 1 + 2 + 0.5 + 1 s in prefill or decode
    assert result.generated_tokens_per_s == pytest.approx((4 + 2 + 1) / 10)  # steps ending inside the loop
    assert result.padding_share == pytest.approx(1 - 26 / 28)  # packed positions
    assert result.padding_share_unpacked == pytest.approx(1 - 26 / 32)  # B x T
    assert result.version_lag_mean == pytest.approx(2.0 * 10 / 20)
    assert result.trained_tokens == 20 and result.trained_tokens_per_s == pytest.approx(2.0)
    assert result.mean_trained_length == pytest.approx(20 / 3)
    assert result.learner_cpu_per_token == pytest.approx(4 / 20)
    assert result.generator_cpu_per_token == pytest.approx(5.0 / (4 + 2 + 1 + 8))  # every step's samples, no switch
    assert result.learner_cpu_share == pytest.approx(4 / 5) and result.generator_cpu_share == pytest.approx(0.5)
    assert result.timeline() == [(0.0, 0), (2.0, 2), (8.0, 3)]


def run(mode: str, rollouts: int, learner_cpu_s: float = 1.0, generator_cpu_s: float = 0.0,
        length: int = 1) -> LoopResult:
    """A 10 s loop that trained ``rollouts`` of ``length`` tokens each in one step; its engine sampled
    as many tokens in one decode step."""
    step = StepRecord(0.0, 1.0, tuple(range(rollouts)), (length,) * rollouts, rollouts * length, rollouts * length,
                      0.0, learner_cpu_s, packed_slots=rollouts * length)
    generated = {i: (length, length) for i in range(rollouts)}
    engine = [EngineStep(0.0, 1.0, "decode", rollouts * length)]
    return LoopResult(spec(mode=mode), GeneratorReport(engine, generated, 0, generator_cpu_s, 10.0),
                      LearnerReport(0.0, 10.0, [step], {}))


def test_pair_ratios_divide_stream_by_sync_whichever_ran_first():
    assert pair_ratios([run("sync", 10), run("stream", 30), run("stream", 20), run("sync", 40)]) == [3.0, 0.5]


def test_a_loop_that_trained_nothing_is_named_instead_of_dividing_by_zero():
    assert untrained_loops([run("sync", 10), run("stream", 30)]) is None
    empty_sync = LoopResult(spec(mode="sync"), GeneratorReport([], {}, 0, 0.0, 1.0), LearnerReport(0.0, 1.0, [], {}))
    why = untrained_loops([empty_sync, run("stream", 30)])
    assert why is not None and "0 (sync)" in why and "--duration-s" in why


def test_pair_ratios_count_tokens_unless_asked_for_rollouts():
    short_stream = [run("sync", 10, length=4), run("stream", 30, length=2)]  # 40 tokens against 60
    assert pair_ratios(short_stream) == [1.5]
    assert pair_ratios(short_stream, "rollouts_per_s") == [3.0]


def test_contention_free_estimate_adds_cpu_times_per_token_for_sync_and_takes_the_larger_for_stream():
    # 10 rollouts of 2 tokens: learner 1.0 s / 20 tokens = 0.05 s per token, generator 0.5 s / 20 = 0.025
    estimate = contention_free_estimate([run("sync", 10, 1.0, 0.5, length=2), run("stream", 10, 0.8, 0.3, length=2)])
    assert estimate["sync"] == pytest.approx(1 / 0.075) and estimate["stream"] == pytest.approx(1 / 0.04)
    estimate = contention_free_estimate([run("sync", 10, 1.0, 0.5, length=2), run("stream", 10, 0.2, 0.9, length=2)])
    assert estimate["stream"] == pytest.approx(1 / 0.045)


def test_balanced_ceiling_is_one_plus_the_generators_cost_ratio_and_bounds_every_learner_cost():
    # generator CPU per token: sync 0.6 s / 20 tokens = 0.03, stream 0.3 s / 20 = 0.015 -> 1 + 2 = 3
    def pair(learner_cpu_s: float) -> list[LoopResult]:
        return [run("sync", 10, learner_cpu_s, 0.6, length=2), run("stream", 10, learner_cpu_s, 0.3, length=2)]

    assert balanced_ceiling(pair(1.0)) == pytest.approx(3.0)
    ratios = {}
    for learner_cpu_s in (0.1, 0.2, 0.3, 0.5, 1.0):  # the learner cheaper than, as cheap as, dearer than the generator
        estimate = contention_free_estimate(pair(learner_cpu_s))
        ratios[learner_cpu_s] = estimate["stream"] / estimate["sync"]
    assert ratios[0.3] == pytest.approx(3.0)  # l = g_stream = 0.015 s per token: (0.03 + 0.015) / 0.015
    assert max(ratios.values()) == pytest.approx(3.0) and ratios[0.1] < ratios[0.3] > ratios[1.0]


def test_mailbox_keeps_a_worker_s_next_loop_message_until_it_is_asked_for():
    results = queue.Queue()
    for message in [("done", "learner", 0, "L0"), ("ready", "learner", 1, None), ("done", "generator", 0, "G0"),
                    ("ready", "generator", 1, None), ("error", "generator", -1, "Traceback: boom")]:
        results.put(message)
    alive = SimpleNamespace(is_alive=lambda: True, exitcode=None)
    mailbox = Mailbox(SimpleNamespace(results=results), {"generator": alive, "learner": alive})
    assert mailbox.expect("done", 0) == {"learner": "L0", "generator": "G0"}
    assert mailbox.expect("ready", 1) == {"learner": None, "generator": None}
    with pytest.raises(RuntimeError, match="boom"):
        mailbox.expect("done", 1)


def test_both_loops_train_every_rollout_they_count_with_the_drawn_lengths(tiny_model_dir, tmp_path):
    args = parse_args(["--median-tokens", "4", "--max-tokens", "24", "--group-size", "2", "--groups-per-batch", "2",
                       "--rollouts", "8", "--repeats", "1", "--model-dir", str(tiny_model_dir),
                       "--out", str(tmp_path / "s.md")])
    results = run_benchmark(args, progress=lambda *_: None)
    assert [r.spec.mode for r in results] == ["sync", "stream"]
    for r in results:
        s, trained_indices = r.spec, [i for step in r.learner.steps for i in step.indices]
        assert r.trained == len(trained_indices) == len(set(trained_indices)) == len(r.learner.planned_tokens)
        assert r.trained >= 8
        assert 0.0 <= r.learner_idle_share <= 1.0 and 0.0 <= r.generator_idle_share <= 1.0
        assert set(trained_indices) <= set(r.generator.generated)
        for step in r.learner.steps:
            for index, produced in zip(step.indices, step.produced_tokens):
                assert produced == r.learner.planned_tokens[index] == response_length(s, index)
        assert all(planned == produced for planned, produced in r.generator.generated.values())
        assert r.generator.swaps >= 1
    sync, stream = results
    assert sync.trained % sync.spec.batch_requests == 0
    for step in sync.learner.steps:  # one whole batch per step, sampled by the weights being trained
        first = min(step.indices)
        assert first % 4 == 0 and sorted(step.indices) == list(range(first, first + 4))
        assert step.version_lag_mean == 0.0
    assert len(stream.generator.generated) >= stream.trained

    plot = tmp_path / "s.png"
    write_plot(results, plot)
    write_report(args, ["--rollouts", "8"], results, plot, 0.0, 0.0)
    assert plot.stat().st_size > 0
    report = (tmp_path / "s.md").read_text()
    assert "Streaming / sync trained tokens/s" in report and "per back-to-back pair" in report
    assert f"draws' mean ({population_mean_length(results[0].spec):.1f} tokens" in report


def test_compile_reaches_the_learner_of_every_loop(tmp_path):
    specs = loop_specs(parse_args(["--repeats", "2", "--compile"]), "unused", tmp_path)
    assert len(specs) == 4 and all(s.trainer.compile for s in specs)
    assert not any(s.trainer.compile for s in loop_specs(parse_args(["--repeats", "1"]), "unused", tmp_path))


def test_engine_compile_reaches_the_generator_of_every_loop(tmp_path):
    specs = loop_specs(parse_args(["--repeats", "1", "--kv-layout", "flat", "--engine-compile"]), "unused", tmp_path)
    assert [s.engine_compile for s in specs] == [True, True]
    assert not any(s.engine_compile for s in loop_specs(parse_args(["--repeats", "1"]), "unused", tmp_path))


@pytest.mark.slow
def test_compiled_learners_compile_before_the_first_loop_and_train_every_rollout(tiny_model_dir, tmp_path):
    args = parse_args(["--median-tokens", "4", "--max-tokens", "24", "--group-size", "2", "--groups-per-batch", "2",
                       "--rollouts", "8", "--repeats", "1", "--model-dir", str(tiny_model_dir), "--compile",
                       "--out", str(tmp_path / "s.md")])
    results = run_benchmark(args, progress=lambda *_: None)
    assert [r.learner.compile_s > 0 for r in results] == [True, False]  # once, in the learner process
    assert all(r.trained >= 8 for r in results)
