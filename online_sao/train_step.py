"""Pieces every learning rule shares: policy log-probs, a finite-guarded optimiser
update, version-lag metrics and a phase timer.

The guard implements the contract of :class:`online_sao.algorithm.Algorithm`: an
update whose loss or gradient norm is not finite is refused before
``optimizer.step`` runs, so no weight and no optimiser state changes.

Under FSDP every rank holds its own share of the batch, so one rank may see a
non-finite loss while the others do not. Each finiteness decision therefore goes
through a :data:`FiniteVote` that all ranks call at the same point
(:func:`trainer.distributed.finite_vote` all-reduces it): either every rank
refuses the update or none does. A rank that refused alone would skip the
backward whose reduce-scatter the others wait in (a hang), or step while its
peers do not (diverged shards).

A policy update whose loss has no gradient at all (every action token outside the
DIS band, or none in the step, and no regularizer on; or a gradient of exactly zero:
every advantage 0, greedy tokens whose log-prob is the constant 0) makes no optimiser
step: AdamW would still move the weights by its momentum, on data that teaches nothing
(SAO.md section 1). Whether any rank's loss has a gradient is agreed through the same vote.

The learning rule as this project implements it: docs/ALGORITHM.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from online_sao.batch import RolloutBatch, pack_layout, padded_share
from online_sao.config import AlgorithmConfig
from online_sao.losses import action_entropy, dis_band_mask, nucleus_entropy, token_logprobs
from online_sao.modeling import packs_correctly
from online_sao.sampling import sampled_logprobs


PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral"})
"""``config.model_type`` of the causal LMs whose logits are exactly ``lm_head(last hidden state)``
(no soft-capping or scaling after the head): for these the head runs only where an action token
is predicted (:func:`policy_forward`)."""


def policy_packs(policy: nn.Module) -> bool:
    """Whether :func:`policy_forward` runs ``policy`` on packed rows: the packing probe's verdict on
    its logits (:func:`online_sao.modeling.packs_correctly`), made at the first call and kept; False
    for an architecture whose packed rows' rollouts would see each other (it runs padded)."""
    def logits(ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return policy(input_ids=ids, position_ids=position_ids, use_cache=False).logits

    return packs_correctly(policy, logits, policy.get_input_embeddings().num_embeddings, type(policy).__name__)


def policy_forward(policy: nn.Module, batch: RolloutBatch, packed: bool | None = None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass of ``policy`` on the batch: ``(log-probs [B, T], entropy [B, T] or None)``.

    The log-probs are those of the batch's action tokens, each under the distribution its token
    was sampled from (temperature and top-p nucleus, as the engine defines it; SAO.md section 1),
    aligned as in :mod:`online_sao.batch`, 0 off action tokens. With ``with_entropy`` the
    entropy of each action token's sampling distribution comes from the same logits
    (:func:`~online_sao.losses.nucleus_entropy`; 0 off action tokens).

    ``packed``: run the policy on the batch packed without padding
    (:class:`~online_sao.batch.PackedLayout`), the LM head only at the positions that predict an
    action token where :func:`_predicting_logits` can; the same values, to float rounding, as
    the padded run (``packed=False``). None (every learner caller): packed where
    :func:`policy_packs` finds the policy keeps a packed row's rollouts apart, else padded."""
    if packed is None:
        packed = policy_packs(policy)
    if not packed:
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        logprobs = token_logprobs(logits, batch.input_ids, batch.temperatures, batch.top_ps) * batch.action_mask
        entropy = action_entropy(logits, batch.action_mask, batch.temperatures, batch.top_ps) if with_entropy else None
        return logprobs, entropy
    layout = pack_layout(batch.attention_mask)
    ids = layout.pack(batch.input_ids)
    # the logits at t - 1 predict token t; a rollout's first token has no prediction of its own in
    # the row (the previous rollout's last logits sit before it), so it gets none, as in a padded row
    starts = layout.position_ids == 0
    predicting = (layout.pack(batch.action_mask, fill=False) & ~starts)[:, 1:]
    logits = _predicting_logits(policy, ids, layout.position_ids, predicting)  # [n, V]
    temperatures = layout.pack(batch.temperatures.to(ids.device), fill=1.0)[:, 1:][predicting]
    top_ps = layout.pack(batch.top_ps.to(ids.device), fill=1.0)[:, 1:][predicting]
    rows, cols = predicting.nonzero(as_tuple=True)

    def placed(values: torch.Tensor) -> torch.Tensor:  # [n] -> [B, T], 0 elsewhere
        zeros = torch.zeros(ids.shape, dtype=values.dtype, device=ids.device)
        return layout.unpack(zeros.index_put((rows, cols + 1), values))

    logprobs = placed(sampled_logprobs(logits, ids[:, 1:][predicting], temperatures, top_ps))
    return logprobs, placed(nucleus_entropy(logits, temperatures, top_ps)) if with_entropy else None


def _predicting_logits(policy: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor,
                       predicting: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` logits at the packed positions ``predicting`` ``[R, C - 1]`` marks.

    A policy of a family in :data:`PLAIN_HEAD_MODEL_TYPES` held by one process runs its LM head
    on those positions only (prompts' logits are never made: less work, and no ``[R, C, V]``
    tensor, which for a large vocabulary is most of the step's memory). A model sharded with
    FSDP2 runs whole: its head's weights are gathered by the root module's forward, which a call
    of its parts would bypass; so does any other family (its forward may change the logits)."""
    if isinstance(policy, FSDPModule) or getattr(policy.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return policy(input_ids=ids, position_ids=position_ids, use_cache=False).logits[:, :-1][predicting]
    hidden = policy.base_model(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state
    return policy.get_output_embeddings()(hidden[:, :-1][predicting])


def policy_logprobs(policy: nn.Module, batch: RolloutBatch, packed: bool | None = None) -> torch.Tensor:
    """``[B, T]`` log-probs of :func:`policy_forward`."""
    return policy_forward(policy, batch, packed)[0]


FiniteVote = Callable[[bool], bool]
"""Agrees on a check across the learner's ranks (a finiteness check; whether no rank's policy loss
has a gradient): called by every rank at the same point with its own result, returns True only
when every rank passed True."""


def local_vote(finite: bool) -> bool:
    """The :data:`FiniteVote` of a single process: its own result."""
    return finite


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def policy_signal_tokens(logprobs: torch.Tensor, batch: RolloutBatch, cfg: AlgorithmConfig, dis: bool) -> int:
    """This rank's action tokens that give a policy loss a gradient: with ``dis`` (the rule masks
    tokens by the DIS band against ``batch.rollout_logprobs``) those inside the band of
    ``logprobs``, else every action token; every action token too while a regularizer
    (``kl_beta``, ``entropy_alpha``) is on, as its terms act on each. 0 means the loss's gradient
    is exactly zero (the count may include tokens whose gradient vanishes for other reasons:
    outside the nucleus, clipped against pi_old, greedy, advantage 0; :func:`guarded_update`
    also skips an update whose gradient norm is exactly 0). Pass it to :func:`guarded_update`."""
    regularized = cfg.kl_beta > 0 or cfg.entropy_alpha > 0
    if not dis or regularized:
        return int(batch.action_mask.sum())
    kept = dis_band_mask(logprobs.detach() - batch.rollout_logprobs, batch.action_mask, cfg.eps_low, cfg.eps_high)
    return int(kept.sum())


@dataclass
class UpdateResult:
    """What one guarded update did."""

    stepped: bool
    """False when the update was refused (the loss or the gradient norm was not finite) or
    skipped as ``empty``: no weight changed."""
    grad_norm: float
    """Total gradient norm before clipping (NaN when the loss itself was not finite)."""
    backward_s: float
    """Seconds in backward and clipping."""
    step_s: float
    """Seconds in optimizer (and scheduler) step."""
    empty: bool = False
    """Skipped because no rank's loss had a gradient (``signal_tokens`` 0, or a gradient norm of
    exactly 0, on every rank): not a refusal."""

    @property
    def refused(self) -> bool:
        """Refused as non-finite (the caller refuses its step)."""
        return not self.stepped and not self.empty


def guarded_update(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    vote: FiniteVote = local_vote,
    signal_tokens: int | None = None,
) -> UpdateResult:
    """Backward, clip to ``max_grad_norm``, step — unless anything is non-finite, or the loss
    has no gradient on any rank.

    The loss is checked before backward and the gradient norm before the step, each
    check agreed through ``vote`` (collective under FSDP: every rank calls this
    function for the same update); a failed check drops the gradients
    (``zero_grad``), skips ``optimizer.step`` and the scheduler, and reports
    ``stepped=False`` (grad_norm NaN when the loss check failed, on every rank).

    ``signal_tokens``: this rank's tokens that give the loss a gradient
    (:func:`policy_signal_tokens`; for the critic its action tokens, the value loss's; None: not
    asked, and no update is skipped as empty). When on every rank it is 0, or the gradient norm is
    exactly 0 (every advantage 0; greedy tokens, whose log-prob is the constant 0), the gradient is
    exactly zero (one more vote, after the gradient's): no ``optimizer.step`` (AdamW would move the
    weights by its momentum and weight decay alone) and no scheduler step (a warm-up counts
    updates, and this is none), reported as ``empty``. Under FSDP the norm is already the global
    one; the vote keeps the decision the same on every rank whatever the norm is.
    The backward still runs first: a policy whose forward gave NaN (every ratio NaN, so no
    token kept) has a non-finite gradient and is refused, as before. Gradients are always
    cleared on return.
    """
    params = optimizer_parameters(optimizer)
    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if not vote(bool(torch.isfinite(loss.detach()))):
        return UpdateResult(stepped=False, grad_norm=math.nan, backward_s=0.0, step_s=0.0)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    backward_s = time.perf_counter() - start
    if not vote(math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return UpdateResult(stepped=False, grad_norm=grad_norm, backward_s=backward_s, step_s=0.0)
    # the vote passes when every rank passes True: here, when no rank's loss has a gradient
    if signal_tokens is not None and vote(signal_tokens == 0 or grad_norm == 0.0):
        optimizer.zero_grad(set_to_none=True)
        return UpdateResult(stepped=False, grad_norm=grad_norm, backward_s=backward_s, step_s=0.0, empty=True)
    start = time.perf_counter()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return UpdateResult(stepped=True, grad_norm=grad_norm, backward_s=backward_s, step_s=time.perf_counter() - start)


def nonfinite_inputs(batch: RolloutBatch, vote: FiniteVote = local_vote) -> bool:
    """True when a reward or an action token's behaviour log-prob is NaN or infinite
    (on any rank's share: agreed through ``vote``, collective under FSDP).

    Such a record is corrupt; the rules refuse the whole batch rather than let DIS
    quietly mask the token or let the value targets become NaN."""
    rewards_ok = bool(torch.isfinite(batch.rewards).all())
    logprobs_ok = bool(torch.isfinite(batch.rollout_logprobs[batch.action_mask]).all())
    return not vote(rewards_ok and logprobs_ok)


def version_lag_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Lag, in policy versions, between the policy being updated and the one that
    sampled each action token (SAO.md section 1)."""
    lag = (batch.policy_version - batch.versions)[batch.action_mask]
    if lag.numel() == 0:
        return {"version_lag_mean": 0.0, "version_lag_max": 0.0}
    return {"version_lag_mean": float(lag.float().mean()), "version_lag_max": float(lag.max())}


def batch_metrics(batch: RolloutBatch, policy_packed: bool, critic_packed: bool | None = None) -> dict[str, float]:
    """Size, reward and lag of a batch, and the share of the model's positions that are padding:
    ``padding_share`` as the policy's forward passes run (packed rows when ``policy_packed``, the
    verdict of :func:`policy_packs`; else the padded batch), ``padding_share_unpacked`` as the
    padded batch would have run. ``critic_packed``: an actor-critic rule's critic's verdict
    (:func:`online_sao.modeling.packing_verdict`; None: no critic, or not probed yet); where it
    differs from the policy's, the critic's share is ``padding_share_critic`` (the critic is a copy
    of the policy's body, so the two agree but where the probe's margin is thin)."""
    packed_share = pack_layout(batch.attention_mask).padding_share
    unpacked_share = padded_share(batch.attention_mask)
    critic = {} if critic_packed is None or critic_packed == policy_packed else {
        "padding_share_critic": packed_share if critic_packed else unpacked_share}
    return {
        "num_rollouts": float(batch.batch_size),
        "num_action_tokens": float(batch.action_mask.sum()),
        # a rank's share holds some of the step's rollouts; the step's rewards are on every rank
        "reward_mean": (sum(batch.step_rewards) / len(batch.step_rewards) if batch.step_rewards
                        else float(batch.rewards.sum(dim=1).mean())),
        "padding_share": packed_share if policy_packed else unpacked_share,
        "padding_share_unpacked": unpacked_share,
        **critic,
        **version_lag_metrics(batch),
    }


@dataclass
class PhaseTimer:
    """Accumulates wall-clock seconds per named phase of a step (reported as
    ``time_<phase>_s``). On a GPU the figures are launch times unless ``synchronize`` is
    given; on CPU they are real."""

    seconds: dict[str, float] = field(default_factory=dict)
    synchronize: Callable[[], None] | None = None
    """Called before and after each phase (e.g. ``torch.cuda.synchronize``): the phase's time is
    then the device's work for it, not the host's launches. It stalls the device at every phase
    boundary, so a learner leaves it unset; benchmarks that split a step by phase set it."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize is not None:
                self.synchronize()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"time_{name}_s": value for name, value in self.seconds.items()}
