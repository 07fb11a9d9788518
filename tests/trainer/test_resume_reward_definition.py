"""A learner restarted under another reward definition (``reward.*`` settings, ``reward.revision``):
the reward statistics learned on the old scale are not restored (trainer/state.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from online_sao.algorithms import build_optimizers
from online_sao.config import RewardConfig
from online_sao.config.algorithm import AlgorithmConfig
from online_sao.modeling import load_policy
from online_sao.schemas import Reward
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.trainer.test_learner_memory import _config
from tests.trainer.test_plasticity import ForgetfulRule
from tests.trainer.traffic import sample_traffic
from trainer.checkpoint import Checkpointer
from trainer.distributed import DistContext, init_distributed
from trainer.join import RewardJoiner
from trainer.learner import RunUntil, train
from trainer.state import Progress, Trainables, gather_training_state, restore_version

ZERO_TO_TEN = {"reward.min_value": 0.0, "reward.max_value": 10.0}
ZERO_TO_ONE = {"reward.min_value": 0.0, "reward.max_value": 1.0}  # the judge rescaled: the same preference
SMALL_DRIFT = {"drift.enabled": True, "drift.recent": 4, "drift.reference": 4}
ONE_PROCESS = DistContext(0, 1, torch.device("cpu"))


def _send(backend, cfg, base, prefix: str, n: int, scale: float) -> None:
    producer = backend.producer()
    for i, interaction in enumerate(sample_traffic(base, n, prefix=prefix)):
        publish(producer, cfg.kafka.topics.interactions, interaction)
        publish(producer, cfg.kafka.topics.rewards, Reward(interaction_id=interaction.interaction_id, source="user",
                                                           value=scale * (0.7 + 0.05 * (i % 3))))
    producer.flush()


def _two_lives(tmp_path, model_dir, first: dict, second: dict, steps: tuple[int, int] = (2, 1)):
    """A learner trained on rewards of 0..10 under ``first``, restarted under ``second`` on rewards a
    tenth as large; the checkpoint each life left."""
    cfg = _config(tmp_path, model_dir, **{"kafka.partitions": 1, **first})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    base = load_policy(model_dir)
    _send(backend, cfg, base, "a", 4 * steps[0], 10.0)
    train(cfg, backend, init_distributed(), RunUntil(max_steps=steps[0]))
    before = Checkpointer(cfg.checkpoint_dir).load_latest()
    cfg2 = _config(tmp_path, model_dir, **{"kafka.partitions": 1, **second})
    _send(backend, cfg2, base, "b", 4 * steps[1], 1.0)
    train(cfg2, backend, init_distributed(), RunUntil(max_steps=steps[1], idle_timeout_s=5))
    return before, Checkpointer(cfg.checkpoint_dir).load_latest()


def test_a_rescaled_reward_does_not_set_the_drift_detector_off_after_a_restart(tmp_path, tiny_model_dir, caplog):
    """The detector compared the old scale's rewards with the new: an alarm at the first step, the
    policy shrunk back to its start, the critic reset, and the start registered as champion."""
    before, after = _two_lives(tmp_path, tiny_model_dir, {**ZERO_TO_TEN, **SMALL_DRIFT}, {**ZERO_TO_ONE, **SMALL_DRIFT})

    assert before.state.reward_definition and after.state.reward_definition != before.state.reward_definition
    assert after.state.counters.get("drift_restarts", 0) == 0
    assert any("learned from rewards of another definition" in r.getMessage() and "drift detector" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("same", [False, True])
def test_the_running_means_reward_window_starts_over_under_a_new_reward_definition(tmp_path, tiny_model_dir, same):
    """running_mean's window kept the old scale's rewards: every new reward's advantage came out far
    below zero for up to running_mean_window rollouts."""
    rule = {"algorithm.name": "running_mean"}
    _, after = _two_lives(tmp_path, tiny_model_dir, {**rule, **ZERO_TO_TEN},
                          {**rule, **(ZERO_TO_TEN if same else ZERO_TO_ONE)}, steps=(1, 1))

    window = after.state.algorithm["reward_window"]
    assert len(window) == (8 if same else 4)  # the first life's four, under the same definition only
    assert max(window[-4:]) < 1.0


def _rule_after_roll_back(tmp_path, definition: str) -> ForgetfulRule:
    """The rule of a learner rolled back, under ``definition``, to a champion checkpointed under 0..10."""
    policy = nn.Linear(2, 1)
    cfg = AlgorithmConfig(optimizer_kernel="for_loop")
    saved = Trainables(policy, None, build_optimizers(cfg, policy, None), ForgetfulRule())
    state = gather_training_state(saved, RewardJoiner(RewardConfig(**_fields(ZERO_TO_TEN)), 10),
                                  Progress(step=2, version=7), ONE_PROCESS)
    Checkpointer(tmp_path).save(state)
    live = Trainables(policy, None, build_optimizers(cfg, policy, None), ForgetfulRule())
    assert restore_version(Checkpointer(tmp_path), live, 7, ONE_PROCESS, definition)
    return live.algorithm


def _fields(overrides: dict) -> dict:
    return {key.removeprefix("reward."): value for key, value in overrides.items()}


def test_a_roll_back_to_a_champion_of_another_reward_definition_starts_the_rules_statistics_over(tmp_path):
    assert _rule_after_roll_back(tmp_path / "same", RewardConfig(**_fields(ZERO_TO_TEN)).definition()).forgotten == 0
    assert _rule_after_roll_back(tmp_path / "new", RewardConfig(**_fields(ZERO_TO_ONE)).definition()).forgotten == 1
