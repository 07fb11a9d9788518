"""How the learner starts: models and the learning rule, the newest checkpoint, and
(optionally) value pre-training, before the loop of :func:`trainer.learner.train` runs.

Every function here is collective: all ranks call it in the same order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from online_sao.algorithms import build_algorithm, build_critic, build_optimizers
from online_sao.config import AlgorithmConfig, Config, ConfigError
from online_sao.critic import ValueModel
from online_sao.dir_lock import DirectoryLock
from online_sao.modeling import compile_body, load_policy, load_tokenizer
from online_sao.regularizers import build_reference
from online_sao.train_step import policy_packs
from streams.base import StreamBackend
from streams.broker_wait import until_broker_takes
from trainer.checkpoint import Checkpointer
from trainer.distributed import DistContext, broadcast_json, broadcast_rollouts, finite_vote, rank_sum, shard_model
from trainer.history import rollouts_from_file, rollouts_from_topics
from trainer.join import RewardJoiner
from trainer.plasticity import DriftResponse
from trainer.publisher import newest_announced_version
from trainer.pretrain import pretrain_critic as fit_critic
from trainer.rank_zero import RankZero
from trainer.state import CheckpointMismatch, Position, Trainables, restore_training_state

log = logging.getLogger(__name__)


TRAINING_DTYPE = "float32"
"""The learner's weights and optimiser state, whatever ``model.dtype`` serving runs: an AdamW step of
1e-5 on a bfloat16 weight of 0.02 (whose rounding step is 1.2e-4) rounds away, and in a test three SAO
steps in bfloat16 changed 15% of the policy's elements against 92% in float32. Published weights
are cast to ``model.dtype`` (trainer/publisher.py); under several ranks the forward and backward
run in it (FSDP2 mixed precision, :func:`trainer.distributed.shard_model`), in one process under
autocast (:meth:`LearnerModels.computing`)."""

ONE_PROCESS_OPTIONS = ("value_shrinkage_window", "value_level_window", "critic_rewarm_rollouts")
"""SAO options whose windows each rank keeps of its own rollouts: under several ranks the shrinkage
and level windows would hold world_size times their rollouts (their sums are added over ranks), and
a checkpoint keeps rank 0's windows only, which a restart gives every rank (docs/ALGORITHM.md)."""


ONE_PROCESS_CRITIC_ORDERS = ("replay_then_judge",)
"""Critic orders with such a window too: the replay window of ``critic_replay_rollouts`` (each rank
would fit its critic on its own window, and a restart gives every rank rank 0's)."""


def check_options_fit_the_ranks(cfg: AlgorithmConfig, world_size: int) -> None:
    """Refuse :data:`ONE_PROCESS_OPTIONS` and :data:`ONE_PROCESS_CRITIC_ORDERS` under several ranks
    (ConfigError naming them)."""
    used = [name for name in ONE_PROCESS_OPTIONS if getattr(cfg, name)]
    if cfg.critic_order in ONE_PROCESS_CRITIC_ORDERS:
        used.append(f"critic_order={cfg.critic_order}")
    if world_size > 1 and used:
        raise ConfigError(f"algorithm.{', algorithm.'.join(used)} run in one process only: each rank would keep a "
                          f"window of its own rollouts, {world_size} times the configured size, and a restart "
                          "would give every rank rank 0's; set them to 0 (another critic_order) or run the learner "
                          "as one process")


@dataclass
class LearnerModels:
    """What every rank trains with, and the two facts of the tokenizer and vocabulary it needs."""

    trainables: Trainables
    pad_token_id: int
    vocab_size: int
    """Token ids at or past it are not the model's (such rollouts are left out)."""
    drift: DriftResponse | None = None
    """The restart on a detected preference change (``drift.enabled``), else None."""
    one_process_compute: torch.dtype | None = None
    """In one process, the dtype the forward and backward run in under autocast when ``model.dtype``
    is not float32 (under several ranks FSDP2's mixed precision does it); None: float32."""

    def computing(self, device: torch.device):
        """The context a step or a fit runs in: autocast to :attr:`one_process_compute`, or nothing."""
        dtype = self.one_process_compute
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def probe_packing(policy: torch.nn.Module, critic: ValueModel | None, reference: torch.nn.Module | None) -> None:
    """Decide, once per model, whether it runs on packed rows (:func:`online_sao.train_step.policy_packs`,
    :meth:`online_sao.critic.ValueModel.packs`; a model whose packed rollouts would see each other
    runs padded, with a warning). Before sharding and compiling: a few dozen tokens of eager work,
    and the forward passes of training then find the verdict made."""
    policy_packs(policy)
    if critic is not None:
        critic.packs()
    if reference is not None:
        policy_packs(reference)


def build_models(cfg: Config, ctx: DistContext) -> LearnerModels:
    """The policy from ``cfg.model_dir``, a critic when the rule needs one (the algorithm
    registry says), the KL penalty's reference policy when it is on, all sharded (and their
    bodies compiled with ``trainer.compile``), the optimisers and the learning rule."""
    check_options_fit_the_ranks(cfg.algorithm, ctx.world_size)
    policy = load_policy(cfg.model_dir, TRAINING_DTYPE)
    vocab_size = policy.get_input_embeddings().num_embeddings
    pad_token_id = load_tokenizer(cfg.model_dir).pad_token_id
    critic = build_critic(cfg.algorithm, policy)
    reference = build_reference(cfg.algorithm, policy)  # the starting policy, before any update
    probe_packing(policy, critic, reference)
    for model in (policy, critic, reference):
        if model is not None:
            shard_model(model, ctx, compute_dtype=getattr(torch, cfg.model.dtype))
            if cfg.trainer.compile:
                compile_body(model)
    opts = build_optimizers(cfg.algorithm, policy, critic)
    algorithm = build_algorithm(cfg.algorithm, policy, critic, opts.policy, opts.critic, opts.critic_scheduler,
                                vote=finite_vote(ctx), reference=reference, sum_over_ranks=rank_sum(ctx))
    ema_reference = reference if cfg.algorithm.kl_reference == "ema" else None  # trains along: checkpointed
    trainables = Trainables(policy, critic, opts, algorithm, ema_reference)
    drift = DriftResponse(cfg.drift, trainables) if cfg.drift.enabled else None  # remembers these starting weights
    compute = getattr(torch, cfg.model.dtype)
    one_process = compute if ctx.world_size == 1 and compute != torch.float32 else None
    return LearnerModels(trainables, pad_token_id, vocab_size, drift, one_process)


CHECKPOINT_LOCK = "learner.lock"
"""The lock file in ``trainer.checkpoint_dir`` (online_sao/dir_lock.py)."""


class CheckpointDirInUse(ConfigError):
    """Another learner holds ``trainer.checkpoint_dir``."""


def hold_checkpoint_dir(directory: Path) -> DirectoryLock:
    """This learner's exclusive hold on its checkpoint directory. Two learners on one (a replacement
    started before the learner it replaces stopped) resumed the same checkpoint, decided on the same
    candidate with different evidence, published one version number with different weights, and then
    both stopped: the old one fenced out of its consumer group, the new one refusing a checkpoint step
    the old one had written. The second is refused at its start instead; started again once the first
    has stopped (a supervisor's restart), it resumes from the first's last checkpoint."""
    def refused(holder: str) -> CheckpointDirInUse:
        return CheckpointDirInUse(f"trainer.checkpoint_dir {directory} is in use by another learner (pid {holder}): "
                                  f"stop it first; one learner per checkpoint directory")

    return DirectoryLock.acquire(directory, CHECKPOINT_LOCK, refused)


def resume(cfg: Config, backend: StreamBackend, models: LearnerModels, ctx: DistContext,
           stop: threading.Event) -> tuple[Position, RankZero | None]:
    """Load the newest checkpoint into every rank (or start fresh); rank 0 then opens its
    streams, weight store and MLflow run (None on the other ranks). Rank 0 holds the checkpoint
    directory first (:func:`hold_checkpoint_dir`), until ``RankZero.close``."""
    lock = hold_checkpoint_dir(cfg.checkpoint_dir) if ctx.is_main else None
    try:
        checkpointer = (Checkpointer(cfg.checkpoint_dir, ledger_segment_bytes=cfg.trainer.ledger_segment_bytes)
                        if ctx.is_main else None)
        joiner = RewardJoiner(cfg.reward, cfg.trainer.join_max_pending)
        try:
            progress = restore_training_state(checkpointer, models.trainables, joiner, ctx, models.drift)
        except CheckpointMismatch as exc:
            raise ConfigError(
                f"the newest checkpoint in trainer.checkpoint_dir ({cfg.checkpoint_dir}) holds a policy that does not "
                f"fit the model of model.path ({cfg.model_dir}), another architecture or size: {exc}. To start from "
                f"this model, point trainer.checkpoint_dir at an empty directory; to go on from the checkpoint, "
                f"set model.path back to the model it was trained from") from exc
        rank0, version = None, progress.version
        if ctx.is_main:
            rank0 = RankZero.open(cfg, backend, checkpointer, joiner, progress, models.vocab_size,
                                  models.pad_token_id, models.trainables.algorithm.group_size, stop)
            rank0.lock = lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:  # until the learner's loop takes it over: a failure (or a stop) ends the run FAILED, frees the port
        if rank0 is not None:
            # never reuse a version number: the store, and the weights topic if the store was lost, may
            # hold versions newer than the checkpoint
            announced = until_broker_takes(  # a broker restarting as the learner starts is waited for
                lambda: newest_announced_version(backend, cfg.kafka.topics.weights, cfg.serving.model_name),
                "reading the weights topic's newest version", stop)
            version = max([version, *rank0.releases.publisher.store.versions(), announced])
        version = broadcast_json(version, ctx)
    except BaseException:
        if rank0 is not None:
            rank0.close("FAILED")
        raise
    if ctx.is_main:
        log.info("learner on %d rank(s) from step %d, policy version %d", ctx.world_size, progress.step, version)
    at = Position(step=progress.step, version=version, checkpointed_step=progress.step,
                  changed_since_publish=progress.step > 0, publish_due=version > progress.version)
    return at, rank0


STARTING_VERSION = 0
"""The version of ``model_dir``'s weights: what serving's engines start on (``initial_version``)."""


def pretrain_on_logged(cfg: Config, backend: StreamBackend, models: LearnerModels, version: int,
                       rank0: RankZero | None, ctx: DistContext) -> None:
    """Value pre-training on logged rollouts of the starting policy (every rank fits on
    all of them, as trainer.pretrain requires); rollouts the model cannot take (a token id past its
    vocabulary) are left out, as the feed leaves them out: one crashed the fit at every restart."""
    logged = None
    if ctx.is_main:
        vocab_size = models.vocab_size
        logged = (rollouts_from_file(cfg.trainer.pretrain_file, cfg, version, vocab_size) if cfg.trainer.pretrain_file
                  else rollouts_from_topics(backend, cfg, version, vocab_size))
    logged = broadcast_rollouts(logged, ctx)
    if not logged:
        if ctx.is_main:
            log.warning("value pre-training skipped: %d logged rollouts of version %d", len(logged), version)
        return
    critic, optimizers = models.trainables.critic, models.trainables.optimizers
    with models.computing(ctx.device):
        fit = fit_critic(critic, optimizers.critic, logged, cfg.algorithm, models.pad_token_id,
                         scheduler=optimizers.critic_scheduler)
    if ctx.is_main:
        log.info("value pre-training on %d rollouts: %s", len(logged), fit)
        rank0.tracker.log_metrics({f"pretrain_{k}": float(v) for k, v in fit.items()}, step=0)


def pretrain_skipped_because(at: Position, models: LearnerModels) -> str:
    """Why ``learn --pretrain-critic`` did not pre-train (it does on a fresh start of a critic's learner
    only): the flag stays in a restart script, and a run that said nothing looked pre-trained."""
    if models.trainables.critic is None:
        return "this algorithm trains no critic"
    if at.step:
        return f"resuming from step {at.step}; pre-training runs only on a fresh start (no checkpoint)"
    return (f"a roll-back just republished the champion's weights as v{at.rolled_back_as}: the policy is not the "
            "starting one")
