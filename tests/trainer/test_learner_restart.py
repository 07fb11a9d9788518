"""A learner restarted after a crash that lost its newest checkpoint (the version it had already
published stays in the weight store): what it checkpoints under a version name is what that version
served, also when it publishes every other step and replays the lost step in other batches."""

from __future__ import annotations

import shutil

import torch

from online_sao.modeling import load_policy
from online_sao.schemas import WeightsNotice, decode
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from tests.trainer.test_learner_memory import _config
from tests.trainer.traffic import produce, sample_traffic
from trainer.checkpoint import Checkpointer
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train


def _published(backend: InMemoryBackend, cfg) -> dict[int, dict[str, torch.Tensor]]:
    """The weights each notice on the weights topic names, as serving would load them."""
    consumer = backend.consumer([cfg.kafka.topics.weights])
    notices = [decode(m.value, WeightsNotice) for m in consumer.poll(timeout_s=0.1, max_records=1000)]
    consumer.close()
    store = FileWeightStore(cfg.weight_store_url)
    return {n.version: store.load(n.location, n.checksum) for n in notices
            if n.action == "publish" and n.version in store.versions()}


def test_a_checkpoint_named_after_a_version_holds_that_versions_weights_after_a_lost_checkpoint(
        tmp_path, tiny_model_dir):
    one_partition = {"kafka.partitions": 1, "trainer.checkpoint_in_background": False}
    cfg = _config(tmp_path, tiny_model_dir, **one_partition)
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    produce(backend.producer(), cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 20, prefix="a"))
    assert train(cfg, backend, init_distributed(), RunUntil(max_steps=3)).version == 3
    checkpointer = Checkpointer(cfg.checkpoint_dir)
    lost = checkpointer.checkpoints()[-1][1]
    assert checkpointer.load(lost).state.version == 3
    shutil.rmtree(lost)  # the crash: v3 went out, its checkpoint never landed

    # publishing every other step, three rollouts a step: the replayed step is not the lost one
    restarted = _config(tmp_path, tiny_model_dir, **one_partition, **{
        "trainer.publish_every": 2, "trainer.min_rollouts": 3, "trainer.max_rollouts_per_step": 3})
    result = train(restarted, backend, init_distributed(), RunUntil(max_steps=1))
    assert result.version == 4  # the first step went out at once, under a new number

    published = _published(backend, cfg)
    assert 3 in published
    for _, path in checkpointer.checkpoints():
        version = checkpointer.load(path).state.version
        first = checkpointer.checkpoint_of_version(version)  # what a roll-back to it restores
        if version in published:
            policy = first.models["policy"]
            assert all(torch.equal(policy[name], tensor) for name, tensor in published[version].items()), \
                f"the checkpoint named v{version} does not hold v{version}'s weights"
