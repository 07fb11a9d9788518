"""The registry's promotion gate and monitors, and what the learner does when the users' preference drifts."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from online_sao.config.base import Section
from online_sao.schemas import MAX_SCORES_PER_REWARD, ScoreName


MIN_GATE_CONFIDENCE = 0.5
"""Lowest ``deploy.gate_confidence``: at 0.5 the interval is already only +-0.67 standard errors;
lower values (1e-300 was accepted: z about 0) make every interval a point and the gate a coin."""


class DeployConfig(Section):
    """The registry's promotion gate and the monitors that can roll a candidate back
    (docs/DEPLOY.md, "The promotion gate")."""

    window: int = Field(128, ge=1)
    """Most recent trained rollouts (with their rewards and behaviour log-probs) kept; candidate
    and champion are both scored on those of them sampled by the candidate's version or newer
    (neither version was trained on those). The checkpoint carries it."""
    gate_min_rollouts: int = Field(32, ge=2)
    """The gate decides only with at least this many rollouts sampled since the candidate in the
    window; fewer: it refuses."""
    gate_min_ess: float = Field(8.0, gt=0)
    """Smallest effective sample size, (sum w)^2 / sum w^2, of either version's importance
    weights on the window; below it the estimate rests on a few rollouts and the gate refuses."""
    gate_confidence: float = Field(0.9, ge=MIN_GATE_CONFIDENCE, lt=1)
    """Two-sided confidence of the normal interval on candidate minus champion (at least 0.5: below,
    the interval is narrower than one standard error each side and the test means little)."""
    gate_margin: float = Field(0.05, ge=0)
    """Non-inferiority margin, in reward units (finite): promote when the interval's lower end is at
    least ``-gate_margin``, roll back when its upper end is below it, otherwise leave it undecided."""
    gate_weight_clip: float | None = Field(None, gt=1)
    """Cap on each rollout's importance ratio pi/mu before self-normalising (None: no cap);
    a cap trades bias for variance when one rollout would carry the whole estimate."""
    gate_champion_record: bool = True
    """When the window cannot judge the champion (it is many versions behind and no canary answers
    with it: its ESS on the window under ``gate_min_ess``, or, with ``gate_coverage_bound``, so
    little of it covered that the decision is undecided), compare the candidate with the champion's
    record instead: its expected reward as last measured on traffic it could be scored on. A record
    never rolls a candidate back, and a drift restart starts without one (online_sao/gate_record.py;
    docs/DEPLOY.md, "The champion's record"). False: such decisions are refused or undecided."""
    gate_coverage_bound: bool = True
    """Widen the gate's interval by what the window cannot see: a version whose answers the window
    rarely samples (its mean importance weight, the share of its probability the window covers,
    under 1) may earn any total reward a rollout can have on the rest (``gate_total_range``;
    online_sao/gate.py, "What the window does not cover"). Set the reward range to the rewards'
    real one: a range wider than they span makes the gate slower to decide. False: the coverage is
    reported, not used."""
    gate_total_range: tuple[float, float] | None = None
    """The smallest and largest total reward a rollout can have, for ``gate_coverage_bound``, where you
    know it better than the configuration says: with ``reward.aggregation`` ``sum`` over several
    sources (two judges rating 0..1: ``[0, 2]``), or with per-turn rewards. None: ``reward.min_value``..
    ``reward.max_value``, and with ``sum`` that range times the 64 rewards the join applies to one
    interaction at most, under which the gate seldom decides on a window that does not cover both
    versions. A window holding a total outside the range decides nothing on the bound (its reason says so)."""
    gate_chunk: int = Field(16, ge=1)
    """Rollouts scored per forward pass when the gate computes a version's log-probs."""
    canary_share: float = Field(0.0, ge=0, lt=1)
    """Share of requests serving answers with the champion instead of the newest version (0: no
    canary). On, the learner announces every new champion on the weights topic, serving holds it
    in a second engine, and the gate adds the champion's own answers since the candidate was
    registered to its window, weighing every answer against the traffic's mixture of serving
    version and champion: the champion's weights stay under 1/share, however far the candidate
    has moved (docs/DEPLOY.md, "Canary")."""
    monitor_max_mean_length: float | None = Field(None, gt=0)
    """Roll back a candidate whose recent answers average more action tokens than this
    (None: off; a reward that pays for length shows here first)."""
    monitor_max_repetition: float | None = Field(None, gt=0, le=1)
    """Roll back a candidate whose recent answers repeat more than this share of their
    ``monitor_ngram``-grams (None: off)."""
    monitor_ngram: int = Field(3, ge=1)
    """n of the n-grams the repetition monitor counts."""
    monitor_max_dead_letter_share: float | None = Field(None, gt=0, le=1)
    """Roll back when more than this share of the records read since the candidate was
    registered went to the dead-letter topic (None: off)."""
    monitor_max_kl: float | None = Field(None, gt=0)
    """Roll back a candidate whose KL from the starting policy (the weights in ``model_dir``),
    estimated on its recent answers as the mean over their action tokens of
    ``k3 = exp(d) - 1 - d``, ``d = log pi_ref - log pi_candidate``, exceeds this (nats per token;
    None: off). On, rank 0 holds one more CPU copy of the policy for the reference."""
    monitor_min_scores: dict[ScoreName, float] = Field({}, max_length=MAX_SCORES_PER_REWARD)
    """Roll back a candidate when the mean of a named score (``Reward.scores``: what the reward's
    source measured besides the reward, e.g. the judge's ``quality``) over its recent answers falls
    below the floor given here, name -> finite floor (empty: off). Answers whose rewards carried no such
    score do not count; with none, the monitor has no value and cannot trip. The scores the window's
    rewards carry are shown as ``monitor_score_<name>`` whether or not they have a floor: the 16 names
    seen first, and every name given here."""
    segments_top_n: int = Field(8, ge=1)
    """Segments shown by name in serving's ``/metrics`` and the learner's MLflow metrics, the
    largest by traffic; every other segment is folded into ``other`` (at most N + 1 labels)."""
    segments_window: int = Field(128, ge=1)
    """Newest rewards per segment over which the learner's ``segment.slot<k>.reward`` (and
    ``segment.other.reward``) is the mean; run tags ``segment.slot<k>`` name each slot's segment.
    The same number of each reward source's newest rewards makes its ``source.<name>.reward``."""

    @field_validator("gate_total_range")
    @classmethod
    def _total_range_is_a_range(cls, bounds: tuple[float, float] | None) -> tuple[float, float] | None:
        if bounds is not None and not bounds[0] < bounds[1]:  # each finite already (the sections refuse inf, NaN)
            raise ValueError(f"gate_total_range must be [low, high] with low < high, got {list(bounds)}")
        return bounds

    @model_validator(mode="after")
    def _window_holds_a_decision(self) -> "DeployConfig":
        # the gate scores at most `window` rollouts, and an ESS never exceeds the rollouts it weighs:
        # a window smaller than either floor refuses every decision and no candidate is ever decided
        if self.window < self.gate_min_rollouts or self.window < self.gate_min_ess:
            raise ValueError(f"window ({self.window}) must hold gate_min_rollouts ({self.gate_min_rollouts}) and "
                             f"gate_min_ess ({self.gate_min_ess:g}): the gate decides on at most window rollouts")
        return self


class DriftConfig(Section):
    """Following a preference switch: a detector on the trained rewards and what the learner
    does when it fires (online_sao/drift.py, trainer/plasticity.py; docs/EXPERIMENTS.md)."""

    enabled: bool = False
    """Watch the rewards for a sustained drop (off: the paper's learner, which never restarts)."""
    recent: int = Field(16, ge=2)
    """Newest trained rewards whose mean is compared with the ``reference`` rewards before them."""
    reference: int = Field(48, ge=2)
    """Rewards before the ``recent`` ones: the level the drop is measured from."""
    min_drop: float = Field(0.2, gt=0)
    """Smallest fall of the mean reward, in reward units, that counts as a drift."""
    z_threshold: float = Field(3.0, gt=0)
    """...and the fall in standard errors (Welch): at 3, one test on a stable reward stream
    alarms with probability about 1e-3 under a normal approximation. Calibrated by replaying
    40 logged drift runs without restarts (docs/EXPERIMENTS.md section 10)."""
    max_version_lag: int | None = Field(8, ge=0)
    """Rewards of answers sampled more than this many versions before the version the learner
    publishes next are left out of the test (not out of training): they say nothing about its
    current policy. Such answers come from a replica an operator holds on an older version
    (``online-sao weights hold``) or one stuck behind; counted, a hold on a worse version reads
    as a preference change and restarts the policy. A streaming learner's answers are about 1-3
    versions old (benchmarks/results/straggler.md: mean lag 2.0-2.1). None: every trained reward
    counts."""
    policy_shrink: float = Field(0.0, ge=0, le=1)
    """On an alarm the policy becomes ``start + policy_shrink * (policy - start)``, ``start`` the
    weights in ``model_dir``: 0 restarts from them (every style sampled at its starting share
    again), 1 keeps the policy (shrink-and-perturb without the perturbation; Ash & Adams 2020)."""
    reset_critic: bool = True
    """On an alarm the critic returns to its initial weights: values fitted under the old
    preference mis-rank the new one's answers (explained variance about -2 after a switch)."""
    reset_optimizers: bool = True
    """On an alarm the optimisers' moment estimates are cleared (they point the old way)."""
    rollback_first: bool = False
    """On an alarm, first return policy and critic to their weights from the start of the
    detector's reference window (the weights that earned the reference level) and restart only
    if the next ``recent`` rewards of answers sampled by the restored version are still below
    that level by the same test. For a drop of the learner's own quality, which a restart would
    answer by discarding what it learned (docs/EXPERIMENTS.md section 17); a real switch pays
    about ``recent`` more rollouts of delay. Keeps about ``(reference + recent) / recent + 2``
    snapshots of policy and critic in memory."""
    rollback_score: str | None = None
    """With ``rollback_first`` (refused without it): roll back only when this named score of the rewards
    (``Reward.scores``, e.g. a judge's ``quality``) fell over the alarm's two windows as well, by
    at least ``rollback_score_z`` Welch standard errors; an alarm with the score held restarts at
    once, since a preference change leaves the answers' quality as it was. Where either window has
    fewer than two rollouts with the score, the alarm rolls back. None: every alarm rolls back first."""
    rollback_score_z: float = Field(2.0, gt=0)
    """The score's fall, in standard errors, that makes an alarm a roll-back (``rollback_score``)."""

    @model_validator(mode="after")
    def _rollback_score_needs_rollback_first(self) -> "DriftConfig":
        # without rollback_first every alarm restarts: the score would be read by nothing, and a
        # config asking for roll-backs tested by a score would silently get none
        if self.rollback_score is not None and not self.rollback_first:
            raise ValueError(f"rollback_score ({self.rollback_score!r}) needs rollback_first: true "
                             "(without it every alarm restarts and the score is never tested)")
        return self
