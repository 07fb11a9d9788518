"""The learning rule: SAO's hyper-parameters, its options outside the paper, and the baselines'."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from online_sao.config.base import Section

RULES_WITH_DIS = frozenset({"sao", "running_mean"})
"""Rules whose policy loss is the DIS loss itself: they apply the DIS mask whatever ``use_dis``
says (grpo puts it on top of its clip only with ``use_dis``; ppo never applies it)."""

RULES_THAT_WHITEN = frozenset({"sao", "ppo"})
"""Rules whose per-token advantages ``normalize_advantages`` whitens. running_mean's and grpo's
advantages are one number per rollout (grpo's already normalised within each group) and never
whitened, so the key is refused for them rather than silently ignored."""


class AlgorithmConfig(Section):
    name: Literal["sao", "running_mean", "grpo", "ppo"] = "sao"
    """Learning rule: SAO, or a baseline kept for comparison (SAO.md section 4)."""
    eps_low: float = Field(0.3, gt=0, lt=1)
    """DIS band: a token is kept only when 1 - eps_low < ratio."""
    eps_high: float = Field(5.0, gt=0)
    """DIS band: a token is kept only when ratio < 1 + eps_high."""
    use_dis: bool = True
    """Apply the DIS mask against the engine's behaviour log-probs. Only grpo can turn it off
    (plain GRPO); sao and running_mean always apply it, so false is refused for them (an
    ablation without DIS would silently run with it); ppo never applies it."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of token-level GAE."""
    lambda_alpha: float = Field(1.5, gt=0)
    """lambda_policy = 1 - 1/(alpha * l), l the number of action tokens of a rollout."""
    lambda_critic: float = Field(1.0, ge=0, le=1)
    """GAE lambda for critic targets (1 = Monte-Carlo returns)."""
    critic_updates: int = Field(2, ge=1)
    """Critic updates per policy step (K)."""
    freeze_critic_attention: bool = True
    """Freeze every attention parameter of the critic."""
    critic_trainable_layers: int | None = Field(None, ge=1)
    """With frozen attention, train the feed-forward blocks of only the last this many decoder
    layers (and the head); None trains those of every layer (the paper's critic). Not in the
    paper: fewer trained parameters memorise fewer particular answers (docs/EXPERIMENTS.md
    section 11)."""
    policy_lr: float = Field(1e-5, gt=0)
    """AdamW learning rate of the policy."""
    critic_lr: float = Field(5e-5, gt=0)
    """AdamW learning rate of the critic (about 5x the policy's)."""
    critic_warmup_steps: int = Field(10, ge=0)
    """Linear warm-up of the critic learning rate, in critic updates."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of both optimisers."""
    optimizer_kernel: Literal["fused", "foreach", "for_loop"] = "fused"
    """How AdamW updates the parameters: ``fused`` (one kernel for all parameters; on CPU the
    optimiser's time in a SAO step of the default model 2.5x less than with ``foreach``, the
    whole step's gain inside the VM's noise: benchmarks/results/learner_optimizer.md),
    ``foreach`` (torch's default: a kernel per operation over all parameters) or ``for_loop``
    (a kernel per operation per parameter). The same update up to float rounding."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping of both models."""
    normalize_advantages: bool = False
    """Whiten the step's advantages to mean 0 and standard deviation 1 over its action tokens (the
    paper does not; off by default). Only sao and ppo whiten; true is refused for running_mean and
    grpo, which do not (an arm 'with whitening' would silently run without)."""
    critic_order: Literal["fit_then_judge", "judge_then_fit", "replay_then_judge"] = "judge_then_fit"
    """Where SAO's K critic updates run relative to the values its advantages use (SAO.md
    section 3). ``fit_then_judge``: K updates on the step's rollouts, then values and advantages
    (the paper's literal reading; the batch's own returns leak into its baseline and shrink its
    advantages). ``judge_then_fit``: values and advantages from the critic as it stands, then K
    updates on the step's rollouts. ``replay_then_judge``: K updates on the last
    ``critic_replay_rollouts`` already-trained rollouts (not this step's), then values and
    advantages, then the step's rollouts join that window. Default ``judge_then_fit``: in the
    drifting-style scenario (8 seeds, docs/EXPERIMENTS.md section 6) no order changed the reward
    measurably, and ``judge_then_fit`` kept advantages 1.5x larger than ``fit_then_judge`` at no
    extra cost (``replay_then_judge`` costs K updates on the whole window per step)."""
    critic_after_metrics: bool = False
    """Under ``critic_order: judge_then_fit``, also report ``value_loss_after`` and
    ``explained_variance_after`` (the critic on the step's rollouts after its K updates): one more
    critic forward per step, which the step's own values do not need (a quarter of the critic's
    forward work at K = 2). The other orders report them always: their advantages use those values."""
    critic_replay_rollouts: int = Field(16, ge=1)
    """Size, in rollouts, of the window of recent already-trained rollouts that
    ``critic_order: replay_then_judge`` fits the critic on (each update is one full-batch
    update on the whole window, so critic compute per step grows with it)."""
    critic_rewarm_rollouts: int = Field(0, ge=0)
    """SAO: after the learner forgets what it learned under an old preference (a drift restart,
    trainer/plasticity.py, which puts the critic back to its freshly built weights), the critic
    re-warms over the next this many rollouts: each step's K updates fit every rollout since the
    restart, and meanwhile the policy's advantages take the mean reward of those rollouts as
    their baseline instead of the cold critic's values (not in the paper, 0 turns it off). Before
    its traffic the learner can pre-train the critic on logged rollouts (``learn
    --pretrain-critic``; 64 in the drift experiments); after a restart no such rollouts exist, so
    the critic learns from the traffic while a running mean stands in for it (SAO.md: a cold critic
    is the main cause of early instability).
    One learner process only (refused under torchrun with several ranks)."""
    value_shrinkage_window: int = Field(0, ge=0)
    """SAO: shrink the critic's values toward the mean reward of the last this many rollouts, by
    the slope of their returns on their out-of-sample values (online_sao/value_shrinkage.py; not
    in the paper, 0 turns it off). Where the critic predicts new answers no better than a
    constant, the advantages fall back to a running-mean baseline instead of carrying its
    errors; where it predicts them, its values stay.
    One learner process only (refused under torchrun with several ranks)."""
    value_level_window: int = Field(0, ge=0)
    """SAO: take the level of the critic's values from the mean reward of the last this many
    rollouts and only their course along each answer from the critic: V'_t = m + V_t - V_first,
    with V_first the critic's value at the rollout's first action token, its estimate of the
    prompt's value (online_sao/value_shrinkage.py; not in the paper, 0 turns it off). For
    traffic whose prompts do not predict the reward, where a critic's level chases its last few
    batches; it discards what the critic knows about one prompt against another.
    One learner process only (refused under torchrun with several ranks)."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a reference policy (SAO.md section 3b; not in the paper, 0 turns
    it off): the k3 estimate exp(d) - 1 - d, d = log pi_ref - log pi_theta, per action token,
    averaged like the DIS loss. Keeps the policy near the reference, so a style it stopped
    preferring is still sampled now and then. Costs one more model copy in the learner (the
    reference) and a forward pass of it per step."""
    kl_reference: Literal["initial", "ema"] = "initial"
    """The reference of the KL penalty: ``initial`` = the policy the learner started from (the
    model directory's weights), ``ema`` = a slow exponential moving average of the policy
    (``kl_ema_rate``), which follows lasting change but not one phase's swing."""
    kl_ema_rate: float = Field(0.01, gt=0, le=1)
    """With ``kl_reference: ema``: after every applied policy update the reference moves this
    share of the way to the policy (reference = (1 - rate) reference + rate policy)."""
    entropy_alpha: float = Field(0.0, ge=0)
    """Weight of the entropy bonus alpha * H(pi_theta) over action tokens (SAO.md section 3b; not
    in the paper, 0 turns it off), averaged like the DIS loss: pushes against one answer mode
    taking all the probability."""
    running_mean_window: int = Field(128, ge=1)
    """W of the running_mean baseline."""
    group_size: int = Field(4, ge=2)
    """G of the grpo baseline."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """PPO/GRPO clip range below 1."""
    clip_high: float = Field(0.28, gt=0)
    """PPO/GRPO clip range above 1 (clip-higher)."""
    ppo_lambda: float = Field(0.95, ge=0, le=1)
    """GAE lambda of the ppo baseline."""
    ppo_epochs: int = Field(2, ge=1)
    """Full-batch policy updates per step of the grpo and ppo baselines, all against
    the pi_old of the step's start (with 1 the clip never acts: pi_old is the policy)."""

    @model_validator(mode="after")
    def _critic_layers_need_frozen_attention(self) -> "AlgorithmConfig":
        if self.critic_trainable_layers is not None and not self.freeze_critic_attention:
            raise ValueError("critic_trainable_layers needs freeze_critic_attention: true "
                             "(it narrows the trained feed-forward blocks)")
        if self.value_shrinkage_window and self.value_level_window:
            raise ValueError("value_shrinkage_window and value_level_window are two ways to bring the "
                             "critic's values toward a running mean: set one of them")
        return self

    @model_validator(mode="after")
    def _only_grpo_runs_without_dis(self) -> "AlgorithmConfig":
        if not self.use_dis and self.name in RULES_WITH_DIS:
            raise ValueError(f"use_dis: false is not possible with name: {self.name}: its policy loss is the DIS "
                             "loss, applied always (only grpo can run without DIS)")
        return self

    @model_validator(mode="after")
    def _only_rules_that_whiten_take_normalize_advantages(self) -> "AlgorithmConfig":
        if self.normalize_advantages and self.name not in RULES_THAT_WHITEN:
            raise ValueError(f"normalize_advantages: true is not possible with name: {self.name}: its advantages "
                             "are one number per rollout and are never whitened (only sao and ppo whiten)")
        return self
