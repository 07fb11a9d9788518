"""The learner under torchrun: two gloo ranks (FSDP2) on the real broker, then the
same checkpoint resumed by a single process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from apps.config import load_app_config
from online_sao.modeling import load_policy
from online_sao.weights import FileWeightStore
from streams.kafka_backend import KafkaBackend
from tests.conftest import _free_port
from tests.trainer.traffic import produce, sample_traffic
from trainer.checkpoint import read_ledger
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.kafka
@pytest.mark.slow
def test_two_ranks_train_publish_and_a_single_process_resumes(tmp_path, kafka_config, tiny_model_dir):
    raw = {
        "paths": {"data_dir": str(tmp_path / "data")},
        "model": {"path": str(tiny_model_dir)},
        "kafka": kafka_config.model_dump(mode="json", exclude_none=True),
        "trainer": {"consumer_group": f"learner-{tmp_path.name}", "min_rollouts": 4, "max_rollouts_per_step": 4,
                    "max_wait_s": None, "poll_timeout_s": 0.1, "max_steps": 2},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    config = tmp_path / "learner.yaml"
    config.write_text(yaml.safe_dump(raw))
    policy = load_policy(tiny_model_dir)
    traffic = sample_traffic(policy, 12, prefix="t")
    producer = KafkaBackend(kafka_config).producer()
    produce(producer, kafka_config.topics, traffic[:8])

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "apps.cli", "--config", str(config), "learn"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "learner on 2 rank(s) from step 0" in done.stderr

    cfg = load_app_config(config, environ={})
    ledger = cfg.checkpoint_dir
    assert sorted(iid for _, iid in read_ledger(ledger)) == sorted(i.interaction_id for i in traffic[:8])
    assert FileWeightStore(cfg.weight_store_url).versions() == [1, 2]

    produce(producer, kafka_config.topics, traffic[8:])
    producer.close()
    result = train(cfg, KafkaBackend(cfg.kafka), init_distributed(), RunUntil(max_steps=1))
    assert result.version == 3
    assert sorted(iid for step, iid in read_ledger(ledger) if step == 3) == sorted(i.interaction_id
                                                                                  for i in traffic[8:])
