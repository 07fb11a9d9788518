"""A non-finite step is refused by every rank together, and the learner publishes
nothing for it, counts it, and marks its ids refused in the ledger.

Ranks are stood in for by threads whose :data:`FiniteVote` exchanges flags through
a barrier (the same contract as the gloo all-reduce of
:func:`trainer.distributed.finite_vote`): a rank that decided alone would stop
voting while its peer waits, and the barrier's timeout turns that hang into a
failure. The two-process gloo version is in test_nonfinite_two_ranks.py (slow).
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest
import torch
from mlflow import MlflowClient

from online_sao.batch import Rollout, collate
from online_sao.modeling import load_policy
from online_sao.schemas import WeightsNotice, decode
from online_sao.train_step import guarded_update, nonfinite_inputs, policy_logprobs
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from tests.fixtures.models import tiny_config
from tests.online_sao.conftest import make_tiny_qwen
from tests.trainer.traffic import produce, sample_traffic
from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState, read_ledger
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, is_refused, train

VOTE_TIMEOUT_S = 60.0
"""How long one thread-rank waits for its peer at a vote (generous: a loaded box)."""
OVERFLOW_REWARD = 1e38
"""A finite reward whose squared error (V - 1e38)^2 overflows float32: the critic loss is inf."""


class ThreadRanks:
    """``size`` threads acting as ranks; :meth:`vote_for` gives each its vote."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=VOTE_TIMEOUT_S)
        self.flags = [True] * size
        self.calls = [0] * size

    def vote_for(self, rank: int):
        def vote(finite: bool) -> bool:
            self.calls[rank] += 1
            self.flags[rank] = finite
            self.barrier.wait()
            agreed = all(self.flags)
            self.barrier.wait()  # nobody writes the next flag before every rank has read this one
            return agreed

        return vote

    def run(self, work) -> list:
        """``work(rank)`` on every rank at once; its results, or the first error raised."""
        results: list = [None] * len(self.flags)
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as exc:  # re-raised below, in the test's thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(len(self.flags))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _weights(*models) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, m in enumerate(models) if m is not None
            for n, p in m.named_parameters()}


def _batch(policy, reward: float, prefix: str):
    """Two on-policy rollouts, the first rewarded ``reward``."""
    rollouts = []
    for i, (tokens, r) in enumerate([([10, 11, 12, 13], reward), ([20, 21, 22, 23], -1.0)]):
        ids = [1, 2, 3, 4] + tokens
        mask = [False] * 4 + [True] * 4
        rollouts.append(Rollout(f"{prefix}{i}", ids, mask, [0.0] * 8, [0] * 8, {7: r}))
    batch = collate(rollouts, pad_token_id=0)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


def test_guarded_update_refuses_when_a_peer_votes_no():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1)
    seen: list[bool] = []

    def peer_has_nan_loss(finite: bool) -> bool:
        seen.append(finite)
        return False

    result = guarded_update((param * 3.0).sum(), opt, max_grad_norm=1.0, vote=peer_has_nan_loss)
    assert seen == [True]  # this rank's loss was fine; the vote refused before backward
    assert not result.stepped and math.isnan(result.grad_norm)
    assert param.grad is None and not opt.state and param.tolist() == [1.0, 2.0]

    answers = iter([True, False])  # losses agree, then a peer's gradient norm is not finite
    seen.clear()

    def peer_has_inf_gradient(finite: bool) -> bool:
        seen.append(finite)
        return next(answers)

    result = guarded_update((param * 3.0).sum(), opt, max_grad_norm=1.0, vote=peer_has_inf_gradient)
    assert seen == [True, True] and not result.stepped
    assert result.grad_norm == pytest.approx(3 * math.sqrt(2))  # local norm reported, not applied
    assert param.grad is None and not opt.state and param.tolist() == [1.0, 2.0]


def test_nonfinite_inputs_on_any_share_refuse_every_share():
    policy = make_tiny_qwen()
    good = _batch(policy, 1.0, "g")
    assert not nonfinite_inputs(good)
    assert nonfinite_inputs(good, vote=lambda finite: False)
    assert nonfinite_inputs(_batch(policy, math.nan, "n"), vote=lambda finite: finite)


@pytest.mark.parametrize("rule", ["sao", "ppo"])
@pytest.mark.parametrize("poison", [math.nan, OVERFLOW_REWARD], ids=["nan-input", "overflowing-loss"])
def test_ranks_refuse_a_step_together_when_one_share_is_not_finite(rule, poison):
    from online_sao.algorithms import build_algorithm, build_critic, build_optimizers
    from online_sao.config import AlgorithmConfig

    cfg = AlgorithmConfig(name=rule, policy_lr=1e-3, critic_lr=5e-3, critic_warmup_steps=0)
    ranks = ThreadRanks(2)
    models, algos = [], []
    for rank in range(2):  # identical replicas, as FSDP shards of one model would be
        policy = make_tiny_qwen()
        critic = build_critic(cfg, policy)
        opts = build_optimizers(cfg, policy, critic)
        algos.append(build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler,
                                     vote=ranks.vote_for(rank)))
        models.append((policy, critic))
    before = [_weights(*pair) for pair in models]
    shares = [_batch(models[0][0], 1.0, "a"), _batch(models[0][0], poison, "b")]  # rank 1 holds the poison

    metrics = ranks.run(lambda rank: algos[rank].step(shares[rank]))

    assert [m["skipped_nonfinite"] for m in metrics] == [1.0, 1.0]
    assert metrics[0].keys() == metrics[1].keys()  # reduce_metrics needs the same names on every rank
    assert ranks.calls[0] == ranks.calls[1]
    for pair, snapshot in zip(models, before):
        after = _weights(*pair)
        assert all(torch.equal(after[k], v) for k, v in snapshot.items()), "a refused step changed a weight"

    # both go on together with the next (finite) step
    ranks.calls = [0, 0]
    metrics = ranks.run(lambda rank: algos[rank].step(_batch(models[0][0], 0.5 - rank, f"c{rank}")))
    assert [m["skipped_nonfinite"] for m in metrics] == [0.0, 0.0]
    assert ranks.calls[0] == ranks.calls[1] > 0


def test_is_refused_reads_the_reduced_metric():
    assert is_refused({"skipped_nonfinite": 1.0}) and is_refused({"skipped_nonfinite": 0.5})
    assert not is_refused({"skipped_nonfinite": 0.0}) and not is_refused({})


def test_ledger_marks_refused_steps(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.record_trained(1, ["a", "b"])
    ckpt.record_trained(2, ["c"], refused=True)
    ckpt.save(Checkpoint(LearnerState(step=2, version=1, offsets={}, joiner={}), models={}, optimizers={}))
    assert read_ledger(ckpt.ledger_path) == [(1, "a"), (1, "b"), (2, "c")]
    assert read_ledger(ckpt.ledger_path, refused=False) == [(1, "a"), (1, "b")]
    assert read_ledger(ckpt.ledger_path, refused=True) == [(2, "c")]


def _poison(ids: set[str]):
    """A ``before_step`` hook: the listed rollouts get an overflowing final reward. Records
    cannot carry one (rewards are bounded by online_sao.schemas.MAX_ABS_REWARD), so the
    fault is injected after validation."""
    def hook(rollouts: list[Rollout]) -> list[Rollout]:
        return [replace(r, rewards={len(r.token_ids) - 1: OVERFLOW_REWARD}) if r.interaction_id in ids else r
                for r in rollouts]

    return hook


def test_learner_refuses_an_overflowing_batch_publishes_nothing_and_counts_it(tmp_path, tiny_model_dir):
    cfg = tiny_config(tmp_path, **{"model.path": str(tiny_model_dir), "kafka.partitions": 1,
                                   "trainer.min_rollouts": 4, "trainer.max_rollouts_per_step": 4,
                                   "trainer.poll_timeout_s": 0.05, "algorithm.policy_lr": 1e-3,
                                   "mlflow.register_every": 100, "mlflow.log_every_steps": 1})  # per step
    topics = cfg.kafka.topics
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    traffic = sample_traffic(load_policy(tiny_model_dir), 12, prefix="o")
    produce(backend.producer(), topics, traffic)  # one partition: each step takes the next four
    poisoned = traffic[5].interaction_id  # in the second step's batch

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=3), before_step=_poison({poisoned}))

    assert (result.steps, result.version) == (3, 2)
    consumer = backend.consumer([topics.weights])
    notices = [decode(m.value) for m in consumer.poll(timeout_s=0.1, max_records=100)]
    consumer.close()
    assert [(n.version, n.step) for n in notices if isinstance(n, WeightsNotice)] == [(1, 1), (2, 3)]
    store = FileWeightStore(cfg.weight_store_url)
    for notice in notices:
        assert all(bool(torch.isfinite(t).all()) for t in store.load(notice.location, notice.checksum).values())

    ledger = cfg.checkpoint_dir
    assert sorted(i for _, i in read_ledger(ledger)) == sorted(i.interaction_id for i in traffic)
    refused = read_ledger(ledger, refused=True)
    assert {s for s, _ in refused} == {2} and poisoned in {i for _, i in refused} and len(refused) == 4
    assert Checkpointer(cfg.checkpoint_dir).load_latest().state.counters["skipped_nonfinite_steps"] == 1

    client = MlflowClient(tracking_uri=cfg.mlflow_uri)
    history = client.get_metric_history(result.run_id, "skipped_nonfinite_steps")
    assert [(m.step, m.value) for m in history] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert [m.value for m in client.get_metric_history(result.run_id, "skipped_nonfinite")] == [0.0, 1.0, 0.0]
