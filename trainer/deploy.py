"""Rank 0's evidence for the registry: the recent window, the off-policy gate that scores
candidate and champion on it, and the monitors (docs/DEPLOY.md, "The promotion gate").

The window is the newest ``deploy.window`` rollouts the learner trained on, rewards and
behaviour log-probs included; the checkpoint carries it, so a restarted learner decides on
the same evidence. The gate scores only the part of it sampled by the candidate's version or
a newer one, rollouts neither version was trained on; with a canary (``deploy.canary_share``)
also the champion's own answers observed since the candidate was registered, every answer
weighed against the traffic's mixture of serving versions and champion. To score a version
the gate loads its published weights from the weight store into one CPU copy of the policy
(built on first use, reused) and runs those rollouts through it in chunks of
``deploy.gate_chunk`` rollouts: on rank 0, outside training. The KL monitor (``deploy.monitor_max_kl``) runs the candidate's
recent answers through that copy (the gate reuses those log-probs) and through a second one
holding the starting policy (``model_dir``; loaded on first use, never changed), whatever the
training rule's own reference is (sharded, perhaps an EMA).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from online_sao.batch import Rollout, collate, rollouts_from_json, rollouts_to_json
from online_sao.config import DeployConfig
from online_sao.gate import GateEvidence, GateSettings, decide, mixture_log_ratios
from online_sao.gate_record import ValueRecord, champion_unscorable, decide_against_record, measure
from online_sao.modeling import load_policy
from online_sao.monitors import (dead_letter_share, mean_answer_length, mean_scores, reference_kl,
                                 repeated_ngram_share)
from online_sao.segments import SCORE_NAMES_TRACKED
from online_sao.train_step import policy_logprobs
from online_sao.weights import WeightsRef, WeightStore

log = logging.getLogger(__name__)


class RecentWindow:
    """The newest ``size`` trained rollouts, plus the learner's read and dead-letter counts
    when the current candidate was registered (the dead-letter monitor's baseline)."""

    def __init__(self, size: int, reward_definition: str = "") -> None:
        self.reward_definition = reward_definition
        """What the rewards of the rollouts observed mean (``RewardConfig.definition``; empty: not known).
        A window checkpointed under another is not restored (:meth:`load_state_dict`)."""
        self.rollouts: deque[Rollout] = deque(maxlen=size)
        self.since_registration: tuple[float, float] = (0.0, 0.0)
        """(records read, dead letters) when the candidate was registered."""
        self.observed = 0
        """Rollouts observed so far (the window keeps the newest of them)."""
        self.registered_at = 0
        """:attr:`observed` when the candidate was registered."""
        self.score_names: list[str] = []
        """The first :data:`~online_sao.segments.SCORE_NAMES_TRACKED` score names the rewards carried
        (checkpointed): the monitors read these and ``deploy.monitor_min_scores``'s. Each becomes an MLflow
        metric, a registry tag and a Prometheus series, and the names are the feedback callers' to
        choose: one new name per reward grew all three without bound."""

    def observe(self, rollouts: list[Rollout]) -> None:
        self.rollouts.extend(rollouts)
        self.observed += len(rollouts)
        self._track_score_names(rollouts)

    def _track_score_names(self, rollouts: Iterable[Rollout]) -> None:
        for rollout in rollouts:
            for name in rollout.scores:
                if name not in self.score_names and len(self.score_names) < SCORE_NAMES_TRACKED:
                    self.score_names.append(name)

    def mark_registration(self, reads: tuple[float, float]) -> None:
        """A candidate was registered now; ``reads``: (records read, dead letters) so far."""
        self.since_registration = reads
        self.registered_at = self.observed

    def canary(self, champion_version: int) -> list[Rollout]:
        """The rollouts observed since the candidate's registration whose every action token the
        champion's version sampled: the canary's answers (``deploy.canary_share``)."""
        newer = min(self.observed - self.registered_at, len(self.rollouts))
        recent = list(self.rollouts)[len(self.rollouts) - newer:]
        return [r for r in recent if {v for v, a in zip(r.versions, r.action_mask) if a} == {champion_version}]

    def versions(self, min_version: int = 0) -> tuple[int, int]:
        """Lowest and highest version that sampled a token of the rollouts :meth:`since`
        ``min_version`` ((0, 0) when there are none)."""
        return versions_of(self.since(min_version))

    def since(self, min_version: int = 0) -> list[Rollout]:
        """The rollouts sampled (in part) by ``min_version`` or newer."""
        return [r for r in self.rollouts
                if max((v for v, a in zip(r.versions, r.action_mask) if a), default=-1) >= min_version]

    def answers(self, min_version: int = 0) -> list[list[int]]:
        """Action tokens of each rollout sampled (in part) by ``min_version`` or newer."""
        return [[t for t, a in zip(r.token_ids, r.action_mask) if a] for r in self.since(min_version)]

    def state_dict(self) -> dict[str, Any]:
        return {"window": rollouts_to_json(list(self.rollouts)), "since_registration": list(self.since_registration),
                "observed": self.observed, "registered_at": self.registered_at,
                "reward_definition": self.reward_definition, "score_names": list(self.score_names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed window. Its rollouts are left out if they were rewarded under another
        reward definition than this window's (the learner restarted with other ``reward.*``
        settings): scored with the rewards of now, they would mix two scales in one decision."""
        self.rollouts.clear()
        kept = rollouts_from_json(state.get("window", []))
        saved = state.get("reward_definition", "")
        if kept and saved and self.reward_definition and saved != self.reward_definition:
            log.warning("the gate's window of %d rollouts was rewarded under reward definition %s, the learner's "
                        "is now %s: not restored; the gate decides on the rollouts trained from now on",
                        len(kept), saved, self.reward_definition)
            kept = []
        self.rollouts.extend(kept)
        read, dead = state.get("since_registration", (0.0, 0.0))
        self.since_registration = (float(read), float(dead))
        # a checkpoint from before the canary: every kept rollout counts as observed since registration
        self.observed = int(state.get("observed", len(self.rollouts)))
        self.registered_at = int(state.get("registered_at", 0))
        # a checkpoint from before the names were kept: those of the restored rollouts, in their order
        self.score_names = list(state.get("score_names", []))[:SCORE_NAMES_TRACKED]
        if "score_names" not in state:
            self._track_score_names(self.rollouts)


def versions_of(rollouts: list[Rollout]) -> tuple[int, int]:
    """Lowest and highest version that sampled an action token of ``rollouts`` ((0, 0) for none)."""
    sampled = [v for r in rollouts for v, a in zip(r.versions, r.action_mask) if a]
    return (min(sampled), max(sampled)) if sampled else (0, 0)


class VersionScorer(Protocol):
    """Sequence log-ratios ``log pi_version - log mu`` of a window under a published version."""

    def log_ratios(self, ref: WeightsRef, window: list[Rollout]) -> torch.Tensor:
        """``[B]``, one per rollout of ``window``."""


class ReferenceScorer(Protocol):
    """KL of a published version from the reference policy on some rollouts."""

    def reference_kl(self, ref: WeightsRef, rollouts: list[Rollout]) -> tuple[float, dict[str, float]]:
        """(k3 mean over the rollouts' action tokens, metrics): :func:`online_sao.monitors.reference_kl`."""


class StoredPolicyScorer:
    """Scores a version by loading its published weights into a CPU copy of the policy.

    The action tokens' log-probs of the last version scored are kept per rollout: at a decision
    the KL monitor and the gate score the candidate on the same answers (those sampled since it),
    and the second asks for nothing new. Scoring another version replaces them."""

    def __init__(self, store: WeightStore, model_dir: Path, dtype: str, pad_token_id: int, chunk: int) -> None:
        self.store = store
        self.model_dir = model_dir
        self.dtype = dtype
        self.pad_token_id = pad_token_id
        self.chunk = chunk
        self._model: nn.Module | None = None
        self._reference: nn.Module | None = None
        self._loaded: WeightsRef | None = None
        self._cached: dict[str, torch.Tensor] = {}
        """interaction id -> ``[A]`` log-probs of its action tokens under ``_loaded``."""
        self.forwarded = 0
        """Rollouts run through a loaded version so far (the reference's not counted)."""

    def _load(self, ref: WeightsRef) -> nn.Module:
        if self._model is None:
            self._model = load_policy(self.model_dir, self.dtype).eval()
        if self._loaded != ref:
            self._model.load_state_dict(self.store.load(ref.location, ref.checksum))
            self._loaded, self._cached = ref, {}
        return self._model

    def _action_logprobs(self, model: nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Each rollout's ``[A]`` action-token log-probs under ``model``, in chunks."""
        out = []
        for start in range(0, len(rollouts), self.chunk):
            batch = collate(rollouts[start:start + self.chunk], self.pad_token_id)
            logprobs = policy_logprobs(model, batch)
            out += [logprobs[i][batch.action_mask[i]] for i in range(logprobs.shape[0])]
        return out

    @torch.no_grad()
    def version_logprobs(self, ref: WeightsRef, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Each rollout's ``[A]`` action-token log-probs under version ``ref`` (kept, see above)."""
        model = self._load(ref)
        missing = [r for r in rollouts if r.interaction_id not in self._cached]
        self._cached.update(zip((r.interaction_id for r in missing), self._action_logprobs(model, missing)))
        self.forwarded += len(missing)
        return [self._cached[r.interaction_id] for r in rollouts]

    def log_ratios(self, ref: WeightsRef, window: list[Rollout]) -> torch.Tensor:
        """``[B]`` sum over each rollout's action tokens of ``log pi_ref - log mu``
        (:func:`online_sao.gate.sequence_log_ratio`, one rollout at a time)."""
        own = self.version_logprobs(ref, window)
        behaviour = [torch.tensor([lp for lp, a in zip(r.logprobs, r.action_mask) if a]) for r in window]
        return torch.tensor([float((o.float() - b).sum()) for o, b in zip(own, behaviour)])

    @torch.no_grad()
    def reference_kl(self, ref: WeightsRef, rollouts: list[Rollout]) -> tuple[float, dict[str, float]]:
        """KL of version ``ref`` from the starting policy (the weights in ``model_dir``) on ``rollouts``."""
        own = self.version_logprobs(ref, rollouts)
        if self._reference is None:
            self._reference = load_policy(self.model_dir, self.dtype).eval()
        reference = self._action_logprobs(self._reference, rollouts)
        own_all, reference_all = torch.cat(own or [torch.zeros(0)]), torch.cat(reference or [torch.zeros(0)])
        return reference_kl(own_all[None], reference_all[None], torch.ones_like(own_all, dtype=torch.bool)[None])


class OffPolicyGate:
    """Candidate and champion, each scored on the same rollouts (:mod:`online_sao.gate`): those
    of the window sampled (in part) by the candidate's version or a newer one. Neither version
    was trained on them (the candidate was published before they were sampled, the champion
    earlier still); on the rollouts it was trained on, a candidate's log-ratio is many nats
    above the rest (its update pushed their rewarded answers up), so its self-normalised
    estimate would rest on a few of them and be biased towards its own training sample
    (docs/DEPLOY.md, "Measured on the drift scenario")."""

    def __init__(self, scorer: VersionScorer, cfg: DeployConfig,
                 reward_range: tuple[float, float] | None = None, reward_definition: str = "") -> None:
        """``reward_range``: (lowest, highest) total reward of a rollout (trainer/rank_zero.py,
        ``gate_reward_range``) for ``deploy.gate_coverage_bound``; None: the interval is not widened. ``reward_definition``: what
        the rewards mean (``RewardConfig.definition``), carried by the records this gate measures;
        empty: not known."""
        self.scorer = scorer
        bounds = reward_range if cfg.gate_coverage_bound and reward_range is not None else (None, None)
        self.settings = GateSettings(cfg.gate_min_rollouts, cfg.gate_min_ess, cfg.gate_confidence, cfg.gate_margin,
                                     cfg.gate_weight_clip, reward_min=bounds[0], reward_max=bounds[1],
                                     reward_definition=reward_definition)
        self.canary_share = cfg.canary_share
        """The share of requests serving answers with the champion (0: no canary)."""
        self.use_records = cfg.gate_champion_record
        """Decide against the champion's record when the champion itself cannot be scored."""

    def compare(self, candidate: WeightsRef, champion: WeightsRef, window: RecentWindow,
                record: Callable[[], ValueRecord | None] | None = None) -> GateEvidence:
        """The decision on ``window.since(candidate.version)`` and, with a canary, the champion's
        own answers observed since the candidate's registration (:meth:`RecentWindow.canary`),
        every answer weighed against the mixture the pool was drawn from, at the pool's own share of
        canary answers (:func:`~online_sao.gate.mixture_log_ratios`). The evidence's ``n`` counts
        the rollouts used (fewer than ``gate_min_rollouts``: refused), ``canary_n`` how many of them
        the champion sampled, and its window versions span the others (the candidate's side: the
        champion's version among them hid a window that lost the candidate's answers). When only the
        champion stood in the way, the window unable to judge it
        (:func:`~online_sao.gate_record.champion_unscorable`; ``deploy.gate_champion_record`` on),
        ``record`` is asked for the champion's record (called only then: finding one may cost a pass
        over the window) and, if there is one, the candidate is decided against it instead
        (online_sao/gate_record.py: it never rolls back)."""
        newest = window.since(candidate.version)
        canary = window.canary(champion.version) if self.canary_share > 0 else []
        rollouts = newest + canary
        rewards = torch.tensor([r.total_reward for r in rollouts], dtype=torch.float64)
        from_canary = torch.tensor([False] * len(newest) + [True] * len(canary))
        # the window's own share of canary answers, not the traffic's: serving answers enter by version
        # and canary answers by when they were observed, so the window holds more of the latter
        share = len(canary) / len(rollouts) if canary else 0.0
        log_cand, log_champ = mixture_log_ratios(self.scorer.log_ratios(candidate, rollouts),
                                                 self.scorer.log_ratios(champion, rollouts), from_canary, share)
        # the versions of the candidate's side only: canary answers are the champion's (canary_n counts them)
        serving = versions_of(newest)
        evidence = decide(rewards, log_cand, log_champ, self.settings, serving)
        if record is not None and self.use_records and champion_unscorable(evidence, self.settings) \
                and (found := record()) is not None:
            evidence = decide_against_record(rewards, log_cand, found, self.settings, serving)
        return replace(evidence, canary_n=len(canary))

    def record_of(self, version: WeightsRef, window: RecentWindow) -> ValueRecord | None:
        """A record for a version that has none (the first candidate, a drift restart): its estimate
        on ``window.since(version.version)``, rollouts it was not trained on; None when that is
        under the gate's floors."""
        rollouts = window.since(version.version)
        if len(rollouts) < self.settings.min_rollouts:
            return None
        rewards = torch.tensor([r.total_reward for r in rollouts], dtype=torch.float64)
        return measure(rewards, self.scorer.log_ratios(version, rollouts), self.settings, versions_of(rollouts))


@dataclass(frozen=True)
class MonitorReading:
    """The monitors' values on the candidate's recent answers and which thresholds they passed."""

    values: dict[str, float]
    tripped: list[str]

    def tags(self) -> dict[str, str]:
        return {**{f"monitor.{k}": repr(v) for k, v in self.values.items()},
                "monitor.tripped": ",".join(self.tripped) or "none"}


def read_monitors(cfg: DeployConfig, window: RecentWindow, since_version: int, records_read: float,
                  dead_letters: float, kl: float | None = None) -> MonitorReading:
    """Length and repetition of the answers sampled by ``since_version`` or newer, the mean of
    each named score their rewards carried (``score_<name>``: the window's first
    SCORE_NAMES_TRACKED names and ``deploy.monitor_min_scores``'s), the dead-letter share since the
    candidate's registration and, when given, ``kl`` (the candidate's KL from the reference on
    those answers, :func:`candidate_kl`), against ``deploy.monitor_*``: a ceiling for each
    ``monitor_max_*``, a floor for each score of ``monitor_min_scores``. A monitor without a
    value (NaN: no answer to measure) does not trip."""
    answers = window.answers(since_version)
    read0, dead0 = window.since_registration
    values = {"mean_length": mean_answer_length(answers),
              "repetition": repeated_ngram_share(answers, cfg.monitor_ngram),
              "dead_letter_share": dead_letter_share(dead_letters - dead0, records_read - read0)}
    ceilings = {"mean_length": cfg.monitor_max_mean_length, "repetition": cfg.monitor_max_repetition,
                "dead_letter_share": cfg.monitor_max_dead_letter_share}
    if kl is not None:
        values["kl"], ceilings["kl"] = kl, cfg.monitor_max_kl
    scores = mean_scores([r.scores for r in window.since(since_version)])
    names = {*cfg.monitor_min_scores, *(name for name in scores if name in window.score_names)}
    values.update({f"score_{name}": scores.get(name, math.nan) for name in sorted(names)})
    floors = {f"score_{name}": floor for name, floor in cfg.monitor_min_scores.items()}
    tripped = [name for name, limit in ceilings.items()
               if limit is not None and math.isfinite(values[name]) and values[name] > limit]
    tripped += [name for name, floor in floors.items() if math.isfinite(values[name]) and values[name] < floor]
    return MonitorReading(values, tripped)


def candidate_kl(scorer: ReferenceScorer, candidate: tuple[int, WeightsRef], window: RecentWindow) -> float:
    """The KL monitor's value: KL of the candidate from the reference on the window's answers
    sampled by the candidate's version or newer (NaN when there are none)."""
    version, ref = candidate
    rollouts = window.since(version)
    return scorer.reference_kl(ref, rollouts)[0] if rollouts else math.nan
