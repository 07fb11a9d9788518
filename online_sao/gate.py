"""The registry's promotion gate: candidate and champion compared on the same logged window.

Every logged rollout carries the behaviour log-probability ``log mu`` of each token it
sampled. For a version ``pi`` the sequence log-ratio of rollout ``i`` is
``l_i = sum over action tokens t of (log pi(x_t) - log mu(x_t))``; its importance weight
is ``w_i = exp(l_i)``, optionally capped at ``clip``. The self-normalised estimate of
the version's expected reward on the window is ``V = sum w_i r_i / sum w_i`` and its
effective sample size ``ESS = (sum w_i)^2 / sum w_i^2`` (n when every weight is equal,
1 when one rollout carries everything).

Both versions are scored on the same rollouts, so their difference ``D = V_cand - V_champ``
is paired. Its standard error is the delta-method (linearised) one of the two ratio
estimators together: with normalised weights ``u_i = w_i / sum w``,
``se^2 = sum_i (u^cand_i (r_i - V_cand) - u^champ_i (r_i - V_champ))^2``.
The decision (:func:`decide`), a non-inferiority test with margin ``m`` on the two-sided
interval ``D +- z se`` at the configured confidence:

- refused: fewer than ``min_rollouts`` rollouts, or either version's ESS below ``min_ess``;
- rolled_back: the whole interval lies below ``-m`` (the candidate is worse by more than m);
- promoted: the interval's lower end is at least ``-m``;
- undecided: the interval straddles ``-m``.

With a canary (``deploy.canary_share``: that share of requests is answered by the champion
itself) the gate pools the serving versions' answers with the champion's own; with ``s`` the
pool's share of canary answers, the pool was drawn from the mixture
``q = (1 - s) pi_serving + s pi_champ``, ``pi_serving`` the version that served an answer. Both
estimates weigh each answer against ``q`` instead of the version that sampled it (the balance
heuristic of multiple importance sampling, with the pool's own counts: :func:`mixture_log_ratios`):
``w_i = pi(x_i) / q(x_i)``. The champion's weights are at most ``1/s``, however far apart it is
from the serving versions, so its ESS does not collapse: where the champion hardly samples what the
serving versions sample, its estimate rests on its own canary answers; where they agree, on all of
them. The candidate's weight is at most ``1/(1 - s)`` on the answers it sampled itself; on those of
later serving versions it is their ratio, as without a canary. ``pi_serving`` of a canary answer is
not known (the newest version when it was answered); the candidate stands in for it. With ``s = 0``
the weights are those above.

**What the window does not cover.** The ESS measures how evenly the weights spread over the
rollouts the window holds; it cannot see probability mass of ``pi`` that the window did not
sample. For any ``pi`` and the behaviour (or mixture) ``q`` the window was drawn from,
``E_q[pi/q] = sum over x with q(x) > 0 of pi(x)``: the mean importance ratio is the mass of ``pi``
on ``q``'s support (Owen, *Monte Carlo theory, methods and examples*, 2013, ch. 9: the
unnormalised estimator of the constant 1). Its window estimate, the **coverage**
``c = min(1, (1/n) sum_i exp(l_i))`` (raw log-ratios, before the rescaling and the clip; in log
space: ``exp(min(0, logsumexp(l) - log n))``), is the share of ``pi``'s mass on what the window
holds, and the self-normalised ``V`` is ``pi``'s value on that share. Of the rest nothing is
known but the reward range ``[r_min, r_max]`` (``reward.min_value``, ``reward.max_value``), so
the version's value lies in ``[c V + (1 - c) r_min, c V + (1 - c) r_max]``. The interval on ``D``
becomes

    low_D  = (c_cand V_cand + (1 - c_cand) r_min) - (c_champ V_champ + (1 - c_champ) r_max) - z se
    high_D = (c_cand V_cand + (1 - c_cand) r_max) - (c_champ V_champ + (1 - c_champ) r_min) + z se

and the rule above is applied to it. With ``c = 1`` for both (both versions well covered, e.g.
identical to the behaviour) it is the interval above, unchanged. A champion that puts most of its
mass where the window rarely samples (``c`` about 0.1) can no longer be "beaten" on the tenth of
its mass the window saw: its upper bound reaches towards ``r_max`` and the candidate stays
undecided. ``c`` is a sample mean of heavy-tailed ratios, so a well-covered version's ``c`` also
falls a little under 1 by chance; the interval then widens by ``(1 - c)(r_max - r_min)``, which is
why the reward range must be the rewards' real one (a range ten times too wide costs ten times
the width). Without a range (``GateSettings.reward_min`` None) the coverage is reported, not used.

The range bounds a rollout's **total** reward (:attr:`Rollout.total_reward`, what ``r_i`` is), not one
reward record's: with ``reward.aggregation`` ``sum`` a total adds several records, and per-turn rewards
add to it whatever the aggregation (the learner passes the range a total can reach:
trainer/rank_zero.py, ``gate_reward_range``). A range the totals break cannot bound the unseen mass,
so where the window holds a total outside it, or the range is not finite, a decision the range took
part in (either coverage under 1) is not made on it: a promotion or roll-back becomes undecided and
the reason says why (:func:`range_problem`). With both coverages 1 the range takes no part and the
decision stands.
A NaN anywhere (an ESS or a value from log-ratios that are ``-inf`` on every rollout: every
answer holds a token outside the version's top-p nucleus) is refused, as an ESS under the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import torch

GateDecision = Literal["promoted", "rolled_back", "undecided", "refused"]
GateBasis = Literal["window", "record"]


@dataclass(frozen=True)
class GateSettings:
    """The gate's part of the config (``deploy.gate_*``)."""

    min_rollouts: int
    min_ess: float
    confidence: float
    margin: float
    weight_clip: float | None = None
    reward_min: float | None = None
    """Smallest total reward a rollout can have (trainer/rank_zero.py, ``gate_reward_range``): the value
    of mass the window does not cover is at least this (module docstring); None, with ``reward_max``:
    the interval is not widened."""
    reward_max: float | None = None
    """Largest total reward a rollout can have."""
    reward_definition: str = ""
    """What the rewards mean (``RewardConfig.definition``): records measured here carry it, and a
    record measured under another is not decided on (online_sao/gate_record.py). Empty: unknown."""

    def __post_init__(self) -> None:
        if (self.reward_min is None) != (self.reward_max is None):
            raise ValueError("reward_min and reward_max are given together or not at all")
        if self.reward_min is not None and not self.reward_min < self.reward_max:
            raise ValueError(f"reward_min ({self.reward_min}) must be below reward_max ({self.reward_max})")


@dataclass(frozen=True)
class GateEvidence:
    """What one decision rested on; :meth:`tags` is what the registry records."""

    decision: GateDecision
    reason: str
    n: int
    candidate_value: float
    champion_value: float
    difference: float
    low: float
    high: float
    candidate_ess: float
    champion_ess: float
    window: tuple[int, int] = (0, 0)
    """Lowest and highest policy version that sampled a token in the window."""
    canary_n: int = 0
    """How many of the ``n`` rollouts the champion sampled itself (a canary's answers)."""
    candidate_se: float = math.nan
    """Standard error of ``candidate_value`` alone (:func:`snis_standard_error`)."""
    champion_se: float = math.nan
    """Standard error of ``champion_value`` alone (on a record: the record's)."""
    basis: GateBasis = "window"
    """``window``: both versions scored on these rollouts; ``record``: the champion could not be
    (its ESS under the floor) and ``champion_*`` are its record (online_sao/gate_record.py)."""
    record_window: tuple[int, int] | None = None
    """With ``basis`` ``record``: the versions whose rollouts the record was measured on."""
    candidate_coverage: float = math.nan
    """The candidate's coverage of the window, ``min(1, mean pi/q)`` (:func:`coverage`)."""
    champion_coverage: float = math.nan
    """The champion's (NaN on a record: not measured on this window)."""

    def tags(self) -> dict[str, str]:
        """``gate.*`` tags for the candidate's registry version."""
        values = {"n": self.n, "candidate_value": self.candidate_value, "champion_value": self.champion_value,
                  "difference": self.difference, "low": self.low, "high": self.high,
                  "candidate_ess": self.candidate_ess, "champion_ess": self.champion_ess,
                  "candidate_se": self.candidate_se, "champion_se": self.champion_se,
                  "candidate_coverage": self.candidate_coverage, "champion_coverage": self.champion_coverage}
        record = {} if self.record_window is None else {
            "gate.record_window_versions": f"{self.record_window[0]}-{self.record_window[1]}"}
        return {"gate.decision": self.decision, "gate.reason": self.reason, "gate.basis": self.basis,
                "gate.window_versions": f"{self.window[0]}-{self.window[1]}", "gate.canary_n": str(self.canary_n),
                **{f"gate.{k}": repr(float(v)) if isinstance(v, float) else str(v) for k, v in values.items()},
                **record}


def sequence_log_ratio(target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                       action_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probs of a version and of the behaviour, ``[B, T]`` bool mask ->
    ``[B]`` sum over action tokens of their difference."""
    diff = (target_logprobs.float() - behaviour_logprobs.float()) * action_mask
    return diff.sum(dim=1)


def importance_weights(log_ratio: torch.Tensor, clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` sequence log-ratios -> ``[B]`` weights ``exp(min(l, log clip))`` scaled by a
    common factor (the largest weight is 1: self-normalised estimates do not see the scale,
    and exp of a large log-ratio would overflow)."""
    capped = log_ratio.double()
    if clip is not None:
        capped = capped.clamp(max=math.log(clip))
    weights = torch.exp(capped - capped.max())
    clipped = float((log_ratio.double() > capped).double().mean()) if clip is not None else 0.0
    return weights, {"clipped_frac": clipped, "log_ratio_max": float(log_ratio.max()),
                     "log_ratio_min": float(log_ratio.min())}


def effective_sample_size(weights: torch.Tensor) -> float:
    """``[B]`` non-negative weights -> ``(sum w)^2 / sum w^2``."""
    return float(weights.sum() ** 2 / (weights ** 2).sum())


def snis_estimate(rewards: torch.Tensor, log_ratio: torch.Tensor,
                  clip: float | None = None) -> tuple[float, dict[str, float]]:
    """Self-normalised importance-sampling estimate of a version's expected reward.
    ``rewards`` ``[B]``, ``log_ratio`` ``[B]`` (:func:`sequence_log_ratio`).
    Returns (estimate, metrics with ``ess``, ``se`` (:func:`snis_standard_error`) and
    :func:`importance_weights`' metrics)."""
    weights, metrics = importance_weights(log_ratio, clip)
    u = weights / weights.sum()
    r = rewards.double()
    value = float((u * r).sum())
    se = float((u * (r - value)).pow(2).sum().sqrt())
    return value, {**metrics, "ess": effective_sample_size(weights), "se": se}


def snis_standard_error(rewards: torch.Tensor, log_ratio: torch.Tensor, clip: float | None = None) -> float:
    """Linearised standard error of :func:`snis_estimate` alone: ``sqrt(sum_i u_i^2 (r_i - V)^2)``
    with ``u = w / sum w``. ``rewards``, ``log_ratio`` ``[B]``."""
    return snis_estimate(rewards, log_ratio, clip)[1]["se"]


def paired_difference(rewards: torch.Tensor, log_ratio_candidate: torch.Tensor, log_ratio_champion: torch.Tensor,
                      clip: float | None = None) -> tuple[float, float, dict[str, float]]:
    """``V_cand - V_champ`` on one window and its standard error (module docstring).
    All inputs ``[B]``. Returns (difference, standard error, metrics: both estimates and ESS)."""
    r = rewards.double()
    parts, metrics = [], {}
    for name, log_ratio in (("candidate", log_ratio_candidate), ("champion", log_ratio_champion)):
        weights, _ = importance_weights(log_ratio, clip)
        u = weights / weights.sum()
        value = float((u * r).sum())
        parts.append(u * (r - value))
        metrics[f"{name}_value"] = value
        metrics[f"{name}_ess"] = effective_sample_size(weights)
        metrics[f"{name}_se"] = float(parts[-1].pow(2).sum().sqrt())
    se = float(((parts[0] - parts[1]) ** 2).sum().sqrt())
    return metrics["candidate_value"] - metrics["champion_value"], se, metrics


def coverage(log_ratio: torch.Tensor) -> float:
    """``[B]`` raw sequence log-ratios (before any clip) -> ``min(1, (1/B) sum_i exp(l_i))``, the
    share of the version's mass on what the window holds (module docstring), computed in log
    space (no overflow). 0 when every ``l_i`` is ``-inf``; NaN when one is NaN."""
    mean_log = float(torch.logsumexp(log_ratio.double(), dim=0)) - math.log(log_ratio.shape[0])
    if math.isnan(mean_log):
        return math.nan
    return math.exp(min(mean_log, 0.0))


def value_bounds(value: float, covered: float, settings: GateSettings) -> tuple[float, float]:
    """A version's value with ``1 - covered`` of its mass unseen: ``(c V + (1 - c) r_min,
    c V + (1 - c) r_max)``; ``(V, V)`` without a reward range in ``settings``."""
    if settings.reward_min is None or settings.reward_max is None or covered >= 1:
        return value, value  # nothing unseen: an infinite range must not make it 0 * inf, NaN
    seen = covered * value
    return seen + (1 - covered) * settings.reward_min, seen + (1 - covered) * settings.reward_max


def _smaller(a: float, b: float) -> float:
    """``min`` that keeps a NaN (Python's ``min(8.0, nan)`` is 8.0)."""
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def _coverage_note(decision: GateDecision, candidate: float, champion: float, settings: GateSettings) -> str:
    """What the reason adds when the reward range widened the interval a decision rests on."""
    if decision == "refused" or settings.reward_min is None or (candidate >= 1 and champion >= 1):
        return ""
    return f" (coverage: candidate {candidate:.3f}, champion {champion:.3f})"


def range_problem(rewards: torch.Tensor, settings: GateSettings) -> str:
    """Why the reward range in ``settings`` cannot bound what the window does not cover (module
    docstring): it is not finite, or the window holds a total reward (``rewards`` ``[B]``) outside it;
    empty when it can, or when there is no range."""
    low, high = settings.reward_min, settings.reward_max
    if low is None or high is None:
        return ""
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"no finite bound on a rollout's total reward is known (range [{low:g}, {high:g}])"
    outside = rewards[(rewards < low) | (rewards > high)]
    if outside.numel() == 0:
        return ""
    return (f"{outside.numel()} rollouts of the window have total rewards outside the range [{low:g}, {high:g}] "
            f"the coverage bound assumes (from {float(outside.min()):g} to {float(outside.max()):g}: rewards "
            f"summed, per turn or by reward.aggregation sum, or sent outside reward.min_value..max_value)")


def not_on_a_broken_range(decision: GateDecision, reason: str, problem: str,
                          coverages: tuple[float, float]) -> tuple[GateDecision, str]:
    """``decision`` (and its ``reason``) unless the reward range took part in it (either of
    ``coverages`` under 1) and cannot bound the unseen mass (``problem``, :func:`range_problem`):
    then a promotion or roll-back becomes undecided, and an undecided one says why as well."""
    if not problem or decision == "refused" or all(c >= 1 for c in coverages):
        return decision, reason
    return "undecided", f"not decided on the coverage bound: {problem} ({reason})"


def decide(rewards: torch.Tensor, log_ratio_candidate: torch.Tensor, log_ratio_champion: torch.Tensor,
           settings: GateSettings, window: tuple[int, int] = (0, 0)) -> GateEvidence:
    """The gate's decision on one window (module docstring): the paired interval, widened by what
    the window does not cover of each version. Inputs ``[B]``."""
    n = int(rewards.shape[0])
    if n == 0:
        nan = math.nan
        return GateEvidence("refused", f"empty window (need {settings.min_rollouts})", 0, nan, nan, nan, nan, nan,
                            0.0, 0.0, window)
    diff, se, m = paired_difference(rewards, log_ratio_candidate, log_ratio_champion, settings.weight_clip)
    z = NormalDist().inv_cdf((1 + settings.confidence) / 2)
    cover_cand, cover_champ = coverage(log_ratio_candidate), coverage(log_ratio_champion)
    cand_low, cand_high = value_bounds(m["candidate_value"], cover_cand, settings)
    champ_low, champ_high = value_bounds(m["champion_value"], cover_champ, settings)
    low, high = cand_low - champ_high - z * se, cand_high - champ_low + z * se
    decision, reason = verdict(n, _smaller(m["candidate_ess"], m["champion_ess"]), low, high, settings)
    decision, reason = not_on_a_broken_range(decision, reason, range_problem(rewards, settings),
                                             (cover_cand, cover_champ))
    return GateEvidence(decision, reason + _coverage_note(decision, cover_cand, cover_champ, settings), n,
                        m["candidate_value"], m["champion_value"], diff, low, high, m["candidate_ess"],
                        m["champion_ess"], window, candidate_se=m["candidate_se"], champion_se=m["champion_se"],
                        candidate_coverage=cover_cand, champion_coverage=cover_champ)


def mixture_log_ratios(log_ratio_candidate: torch.Tensor, log_ratio_champion: torch.Tensor,
                       from_canary: torch.Tensor, canary_share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-ratios against the mixture ``q`` a pool of answers was drawn from when a share
    ``canary_share`` ``s`` of them was answered by the champion (module docstring, "With a canary").
    All ``[B]``; ``from_canary`` bool: the champion answered. Returns ``(log pi_cand / q,
    log pi_champ / q)`` per answer."""
    if not 0 <= canary_share <= 1:
        raise ValueError(f"canary_share must lie in [0, 1], got {canary_share}")
    if canary_share == 0:
        return log_ratio_candidate, log_ratio_champion
    if canary_share == 1:  # the champion answered every one: q is the champion
        return (log_ratio_candidate.double() - log_ratio_champion.double(),
                torch.zeros_like(log_ratio_champion, dtype=torch.float64))
    l_cand, l_champ = log_ratio_candidate.double(), log_ratio_champion.double()
    # log(pi_serving / mu): 0 where the serving version sampled; the candidate stands in for it on a canary answer
    l_serving = torch.where(from_canary, l_cand, torch.zeros_like(l_cand))
    log_q = torch.logaddexp(math.log(1 - canary_share) + l_serving, math.log(canary_share) + l_champ)
    return l_cand - log_q, l_champ - log_q


def verdict(n: int, ess: float, low: float, high: float, settings: GateSettings,
            may_roll_back: bool = True) -> tuple[GateDecision, str]:
    """The decision rule alone: window size ``n``, the smaller of the two ESS, the interval
    ``[low, high]`` on candidate minus champion. ``may_roll_back`` False turns a roll-back into
    undecided (a champion's record may predate a preference change: online_sao/gate_record.py).
    A NaN ESS or interval is refused like an ESS under the floor. Returns (decision, reason)."""
    bound = -settings.margin
    if n < settings.min_rollouts:
        return "refused", f"n={n} < min_rollouts={settings.min_rollouts}"
    if not ess >= settings.min_ess:  # NaN too
        return "refused", f"ess={ess:.2f} < min_ess={settings.min_ess}"
    if math.isnan(low) or math.isnan(high):
        return "refused", f"interval [{low:.4f}, {high:.4f}] is not a number"
    if high < bound and not may_roll_back:
        return "undecided", f"upper end {high:.4f} < -margin {bound}, but a record cannot roll back"
    if high < bound:
        return "rolled_back", f"upper end {high:.4f} < -margin {bound}"
    if low >= bound:
        return "promoted", f"lower end {low:.4f} >= -margin {bound}"
    return "undecided", f"interval [{low:.4f}, {high:.4f}] contains -margin {bound}"
