"""Rank 0's close: every part closed even when one fails, and the loop's own error kept."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

from online_sao.config import DeployConfig, RewardConfig
from online_sao.gate import GateSettings, decide
from online_sao.schemas import decode
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from tests.trainer.test_deploy import registry_cfg  # noqa: F401  (fixture)
from tests.trainer.test_tracking import empty_store  # noqa: F401  (fixture)
from trainer.checkpoint import Checkpointer
from trainer.join import RewardJoiner
from trainer.rank_zero import RankZero, gate_reward_range
from trainer.state import Progress
from trainer.tracking import RunTracker


class Part:
    """One closable part; ``error`` is raised by its close."""

    def __init__(self, closed: list[str], name: str, error: Exception | None = None) -> None:
        self.closed, self.name, self.error = closed, name, error

    def close(self, *status) -> None:
        self.closed.append(self.name if not status else f"{self.name}:{status[0]}")
        if self.error is not None:
            raise self.error


def rank_zero(closed: list[str], failing: dict[str, Exception]) -> RankZero:
    def part(name):
        return Part(closed, name, failing.get(name))
    return RankZero(checkpointer=None, feed=part("feed"), releases=None, tracker=part("tracker"),
                    producer=part("producer"), counters={}, segments=None, writer=part("writer"),
                    exporter=part("exporter"))


def test_a_failing_part_does_not_keep_the_others_open_and_its_error_is_raised_after():
    closed: list[str] = []
    broken = OSError("producer flush failed")
    with pytest.raises(OSError) as raised:
        rank_zero(closed, {"producer": broken, "tracker": RuntimeError("second")}).close("FINISHED")
    assert raised.value is broken  # the first failure
    assert closed == ["writer", "exporter", "feed", "producer", "tracker:FINISHED"]


def test_while_the_loop_fails_a_close_failure_is_logged_and_the_loops_error_propagates(caplog):
    closed: list[str] = []
    zero = rank_zero(closed, {"writer": OSError("background checkpoint: disk full"),
                              "tracker": RuntimeError("mlflow: database is locked")})

    def loop():
        try:
            raise ValueError("the step failed")
        finally:
            zero.close("FAILED")

    with caplog.at_level(logging.ERROR, logger="trainer.rank_zero"), pytest.raises(ValueError, match="the step failed"):
        loop()
    assert closed == ["writer", "exporter", "feed", "producer", "tracker:FAILED"]
    logged = caplog.text
    assert "closing the checkpoint writer failed" in logged and "disk full" in logged
    assert "closing the MLflow run failed" in logged and "database is locked" in logged


def test_without_an_exporter_the_rest_is_closed():
    closed: list[str] = []
    zero = rank_zero(closed, {})
    zero.exporter = None
    zero.close("FINISHED")
    assert closed == ["writer", "feed", "producer", "tracker:FINISHED"]


def test_opening_with_a_canary_announces_the_registrys_champion(registry_cfg):
    """A promotion stopped before its notice reached the broker is never decided again: rank 0
    announces the registry's champion when it opens (tests/trainer/test_registry_faults.py)."""
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"canary_share": 0.25})})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    ref = FileWeightStore(cfg.weight_store_url).save(1, {"w": torch.ones(2)})
    tracker = RunTracker(cfg)
    tracker.registry.register(ref, 0.0)
    tracker.registry.record_decision("promoted", {}, ref)
    rank0 = RankZero.open(cfg, backend, Checkpointer(cfg.checkpoint_dir), RewardJoiner(cfg.reward, 100),
                          Progress(mlflow_run_id=tracker.run_id), vocab_size=16, pad_token_id=0, group_size=1,
                          stop=threading.Event())
    try:
        notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
        assert [(n.action, n.version) for n in notices] == [("champion", 1)]
    finally:
        rank0.close("FINISHED")


def backend_telling_closes(cfg) -> tuple[InMemoryBackend, list[str]]:
    """An in-memory backend whose producers say in the list when they are closed."""
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    closed: list[str] = []
    producer = backend.producer

    def tracked_producer():
        made = producer()
        close = made.close
        made.close = lambda *args: (closed.append("producer"), close(*args))[1]
        return made

    backend.producer = tracked_producer
    return backend, closed


def test_a_start_that_fails_after_the_run_opened_marks_it_failed_and_closes_what_it_opened(registry_cfg):
    """The metrics port taken by another process: the run was left RUNNING and the producer open."""
    import socket

    from mlflow import MlflowClient

    from online_sao.config import ConfigError

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cfg = registry_cfg.model_copy(update={"trainer": registry_cfg.trainer.model_copy(
        update={"metrics_host": "127.0.0.1", "metrics_port": taken.getsockname()[1]})})
    backend, closed = backend_telling_closes(cfg)
    try:
        with pytest.raises(ConfigError):
            RankZero.open(cfg, backend, Checkpointer(cfg.checkpoint_dir), RewardJoiner(cfg.reward, 100), Progress(),
                          vocab_size=16, pad_token_id=0, group_size=1, stop=threading.Event())
    finally:
        taken.close()
    client = MlflowClient(cfg.mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"] and closed == ["producer"]


def test_a_stop_in_resume_after_rank_zero_opened_marks_the_run_failed_and_closes_it(registry_cfg, monkeypatch):
    """A Ctrl-C while resume read the weights topic, after RankZero.open and before the loop's own
    try: the run stayed RUNNING and the producer open."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    import trainer.startup as startup
    from trainer.distributed import DistContext

    backend, closed = backend_telling_closes(registry_cfg)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(startup, "newest_announced_version", interrupted)
    models = SimpleNamespace(trainables=SimpleNamespace(algorithm=SimpleNamespace(group_size=1)), vocab_size=16,
                             pad_token_id=0, drift=None)
    with pytest.raises(KeyboardInterrupt):
        startup.resume(registry_cfg, backend, models, DistContext(0, 1, torch.device("cpu")), threading.Event())
    client = MlflowClient(registry_cfg.mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name(registry_cfg.mlflow.experiment).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"] and closed == ["producer"]


def test_the_gate_is_given_the_range_of_a_rollouts_total_not_of_one_reward():
    """With aggregation sum a total adds up to 64 rewards (MAX_REWARDS_PER_INTERACTION); first, last and
    mean keep one reward's range; deploy.gate_total_range, where set, is the range."""
    def reward(low, high, aggregation):
        return RewardConfig(min_value=low, max_value=high, aggregation=aggregation, default_value=low)
    derived = DeployConfig()
    assert gate_reward_range(reward(0.0, 1.0, "sum"), derived) == (0.0, 64.0)
    assert gate_reward_range(reward(-1.0, 2.0, "sum"), derived) == (-64.0, 128.0)
    assert gate_reward_range(reward(0.5, 1.0, "sum"), derived) == (0.5, 64.0)  # at least one reward of 0.5
    assert gate_reward_range(reward(-3.0, -1.0, "sum"), derived) == (-192.0, -1.0)
    for aggregation in ("first", "last", "mean"):
        assert gate_reward_range(reward(0.0, 1.0, aggregation), derived) == (0.0, 1.0)
    two_judges = DeployConfig(gate_total_range=[0, 2])
    assert gate_reward_range(reward(0.0, 1.0, "sum"), two_judges) == (0.0, 2.0)


@pytest.mark.parametrize("bounds", [[1, 1], [2, 0], [0, float("inf")], [float("nan"), 1]])
def test_a_total_range_that_is_no_range_is_refused(bounds):
    with pytest.raises(ValueError, match="gate_total_range"):
        DeployConfig(gate_total_range=bounds)


def test_a_champion_worse_on_what_the_window_missed_is_not_promoted_under_summed_rewards(registry_cfg):
    """The hunter's case in 20 rollouts, rewards of two sources summed (each in [0, 1]): the candidate
    answers A (reward 0.5) twice and B (1.0) 18 times, its ratio 1; the champion puts 0.6 on A (ratio 6),
    nothing on B and 0.4 on X, which pleases both sources (2.0) and the window never holds. V_cand 0.95,
    V_champ 0.5 on 0.6 of its mass, se^2 = 2 * 0.0225^2 + 18 * 0.0025^2. Given [0, 1] the champion was
    at most 0.3 + 0.4 = 0.7 and the candidate promoted (true D = 0.95 - 1.1 = -0.15); rank 0 gives the
    gate [0, 64]: at most 0.3 + 0.4 * 64 = 25.9."""
    cfg = registry_cfg.model_copy(update={"reward": RewardConfig(min_value=0.0, max_value=1.0, aggregation="sum")})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    rank0 = RankZero.open(cfg, backend, Checkpointer(cfg.checkpoint_dir), RewardJoiner(cfg.reward, 100), Progress(),
                          vocab_size=16, pad_token_id=0, group_size=1, stop=threading.Event())
    try:
        settings = rank0.releases.gate.settings
    finally:
        rank0.close("FINISHED")
    assert (settings.reward_min, settings.reward_max) == (0.0, 64.0)
    settings = GateSettings(4, 2.0, 0.9, 0.05, reward_min=0.0, reward_max=64.0)  # the hand case's floors
    rewards = torch.tensor([0.5] * 2 + [1.0] * 18)
    champion = torch.tensor([math.log(6.0)] * 2 + [-math.inf] * 18)
    se = math.sqrt(2 * 0.0225 ** 2 + 18 * 0.0025 ** 2)
    z = 1.6448536269514722
    evidence = decide(rewards, torch.zeros(20), champion, settings)
    assert evidence.champion_coverage == pytest.approx(0.6) and evidence.candidate_value == pytest.approx(0.95)
    assert evidence.low == pytest.approx(0.95 - 25.9 - z * se) and evidence.decision == "undecided"
    narrow = decide(rewards, torch.zeros(20), champion, GateSettings(4, 2.0, 0.9, 0.05, reward_min=0.0, reward_max=1.0))
    assert narrow.low == pytest.approx(0.95 - 0.7 - z * se) and narrow.decision == "promoted"


def test_the_step_line_shows_the_readings_the_step_has_and_no_nan_for_the_others():
    """Every running_mean and grpo step logged "value loss nan, critic EV nan", every ppo step "kept nan"."""
    from trainer.rank_zero import step_readings

    assert step_readings({"kept_frac": 0.97, "value_loss": 0.01234, "explained_variance": 0.4}) == \
        "kept 0.97, value loss 0.0123, critic EV 0.40, "
    assert step_readings({"kept_frac": 1.0, "reward_mean": 0.5}) == "kept 1.00, "  # running_mean: no critic
    assert step_readings({}) == ""
