"""A learner restarted on another ``model.path`` over the checkpoints of the old one: a model of
another architecture is refused with one line saying what to do (it was load_state_dict's 30-line
traceback); one of the same architecture is overridden by the checkpoint, and the log says so."""

from __future__ import annotations

import logging

import pytest

from apps.default_model.builder import build_base_model
from online_sao.config import ConfigError
from online_sao.modeling import load_policy
from streams.memory import InMemoryBackend
from tests.fixtures.models import tiny_config
from tests.trainer.test_learner_memory import _config
from tests.trainer.traffic import produce, sample_traffic
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory):
    """A tiny model of another size than ``tiny_model_dir``'s (hidden size 48, not 32)."""
    cfg = tiny_config(tmp_path_factory.mktemp("wider-model"), **{"model.base.hidden_size": 48,
                                                                 "model.base.train_steps": 1})
    return build_base_model(cfg, progress=lambda *_: None)


def _trained_one_step(tmp_path, model_dir):
    cfg = _config(tmp_path, model_dir, **{"kafka.partitions": 1})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    produce(backend.producer(), cfg.kafka.topics, sample_traffic(load_policy(model_dir), 4))
    assert train(cfg, backend, init_distributed(), RunUntil(max_steps=1)).version == 1
    return backend


def test_a_model_path_of_another_architecture_over_old_checkpoints_is_one_clear_error(
        tmp_path, tiny_model_dir, wider_model_dir):
    backend = _trained_one_step(tmp_path, tiny_model_dir)
    cfg = _config(tmp_path, wider_model_dir, **{"kafka.partitions": 1})
    with pytest.raises(ConfigError) as raised:
        train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    message = str(raised.value)
    assert f"trainer.checkpoint_dir ({cfg.checkpoint_dir})" in message
    assert f"model.path ({cfg.model_dir})" in message
    assert "in the checkpoint" in message and "[512, 32]" in message and "[512, 48]" in message  # the shapes
    assert "point trainer.checkpoint_dir at an empty directory" in message and "\n" not in message


def test_a_checkpoint_restored_over_model_path_says_model_paths_weights_are_not_used(
        tmp_path, tiny_model_dir, caplog):
    backend = _trained_one_step(tmp_path, tiny_model_dir)
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1})
    with caplog.at_level(logging.INFO, logger="trainer.state"):
        assert train(cfg, backend, init_distributed(), RunUntil(idle_timeout_s=0.5)).steps == 0
    assert any("resuming the policy of the checkpoint of step 1 (model.path's weights are not used"
               in r.getMessage() for r in caplog.records)
