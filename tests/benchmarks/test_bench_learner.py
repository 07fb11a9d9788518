"""The learner benchmark's command line (overrides reach the learner's YAML as nested sections), the
notice a trained rollout is first served under, the learner's thread count as reported, the wait for
the learner to settle (a fake clock) and a phase's figures."""

import os

import pytest

from benchmarks import bench_learner
from benchmarks.bench_learner import first_publication, learner_threads, main, nest, parse_overrides, phase, phase_row
from online_sao.schemas import WeightsNotice


def test_overrides_are_read_as_yaml_and_nested():
    overrides = parse_overrides(["trainer.min_rollouts=1", "trainer.max_wait_s=null", "algorithm.name=sao"])
    assert overrides == {"trainer.min_rollouts": 1, "trainer.max_wait_s": None, "algorithm.name": "sao"}
    raw = {"trainer": {"checkpoint_every": 5}}
    for key, value in overrides.items():
        nest(raw, key.split("."), value)
    assert raw == {"trainer": {"checkpoint_every": 5, "min_rollouts": 1, "max_wait_s": None},
                   "algorithm": {"name": "sao"}}


def test_an_override_without_a_value_is_refused():
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_overrides(["trainer.min_rollouts"])


def test_out_naming_a_directory_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert "directory" in capsys.readouterr().err


def _notice(step: int, version: int) -> WeightsNotice:
    return WeightsNotice(version=version, step=step, location=f"v{version}", checksum="0" * 64)


def test_a_step_that_did_not_publish_is_served_by_the_next_step_that_did():
    # trainer.publish_every 3: steps 3 and 6 published versions 1 and 2
    notices = {3: _notice(3, 1), 6: _notice(6, 2)}
    steps = sorted(notices)
    assert first_publication(steps, notices, 1).version == 1
    assert first_publication(steps, notices, 3).version == 1
    assert first_publication(steps, notices, 4).version == 2
    assert first_publication(steps, notices, 7) is None


def test_the_learners_threads_are_those_of_a_process_started_with_its_environment():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert learner_threads(env) == 1
    assert learner_threads({**os.environ, "OMP_NUM_THREADS": "2"}) == 2


class FakeTime:
    """The module's clock: ``sleep`` moves it on at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class RunningLearner:
    def poll(self) -> None:
        return None


def test_the_settle_countdown_starts_at_the_first_rollout_trained(monkeypatch):
    """A learner that trains nothing for its first 30 s (model load, MLflow on a busy machine): the
    wait ended after SETTLE_S with nothing trained, and the live traffic started on top of the backlog."""
    clock = FakeTime()
    monkeypatch.setattr(bench_learner, "time", clock)
    first_trained_s = 30.0

    def trained() -> set[str]:  # one of the two ids, from first_trained_s on (the other is never trained)
        return {"a"} if clock.now >= first_trained_s else set()

    bench_learner.wait_until_trained({"a", "b"}, trained, RunningLearner())
    assert first_trained_s + bench_learner.SETTLE_S <= clock.now < first_trained_s + bench_learner.SETTLE_S + 1.0


def test_the_wait_ends_as_soon_as_every_id_is_trained(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(bench_learner, "time", clock)
    bench_learner.wait_until_trained({"a"}, lambda: {"a", "b"} if clock.now >= 3.0 else set(), RunningLearner())
    assert 3.0 <= clock.now < 4.0


def _history(steps: dict[int, tuple[int, float]]) -> dict[str, dict[int, float]]:
    """Metrics of steps ``step -> (rollouts, cycle seconds)``: 10 tokens a rollout, a quarter of each
    cycle waiting for data, 0.5 s each of step, publish, checkpoint and write."""
    names = ("step_time_s", "publish_time_s", "checkpoint_time_s", "checkpoint_write_s")
    history = {"num_rollouts": {s: float(n) for s, (n, _) in steps.items()},
               "num_action_tokens": {s: 10.0 * n for s, (n, _) in steps.items()},
               "rollouts_per_s": {s: n / cycle for s, (n, cycle) in steps.items()},
               "data_wait_share": {s: 0.25 for s in steps}}
    return {**history, **{name: {s: 0.5 for s in steps} for name in names}}


def test_a_phase_without_steps_is_reported_as_na():
    """Every step trained backlog and live rollouts together: the phase's rates divided by zero and
    the benchmark died after the whole run, with no report."""
    assert phase(_history({1: (4, 2.0)}), []) is None
    row = phase_row("live", None)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells == ["live", "0", *["n/a"] * 9]


def test_a_phases_rates_are_per_cycle():
    p = phase(_history({1: (4, 2.0), 2: (8, 6.0)}), [1, 2])
    assert (p["steps"], p["rollouts"], p["tokens"], p["seconds"]) == (2, 12, 120, 8.0)
    assert p["rollouts_per_s"] == 1.5 and p["tokens_per_s"] == 15.0 and p["wait_share"] == 0.25
    assert phase_row("backlog", p) == "| backlog | 2 | 12 | 120 | 1.50 | 15.0 | 25.0% | 0.500 | 0.500 | 0.500 | 0.500 |"
