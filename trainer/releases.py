"""Releasing policy versions: publishing (:class:`~trainer.publisher.Publisher`) and the registry.

Registry cadence (:class:`Releases`): every ``mlflow.register_every``
versions, the candidate registered last time is decided on first: the off-policy gate
scores it and the champion on the same recent rollouts, those sampled since the candidate was
published (trainer.deploy, online_sao.gate), and the monitors read its recent answers; it is
promoted, rolled back (serving and the learner return to the champion), or left pending (the
gate refused or could not tell; the next registration supersedes it). Unless it was rolled
back, the new version is then registered as the next candidate. Every new champion is also
announced (``action="champion"``): with a canary (``deploy.canary_share``) serving answers the
canary share with it, and ``online-sao weights hold --champion`` reads it there; so is a champion
moved by hand, once a registry read finds it (the next decision).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from online_sao.config import DeployConfig
from online_sao.gate import GateEvidence
from online_sao.gate_record import ValueRecord, candidate_record, champion_record, comparable
from online_sao.weights import CorruptWeights, WeightsRef
from trainer.deploy import OffPolicyGate, RecentWindow, ReferenceScorer, candidate_kl, read_monitors
from trainer.distributed import DistContext, broadcast_json
from trainer.full_state import full_state_dict
from trainer.publisher import Publisher
from trainer.registry import Decision
from trainer.registry_versions import ROLLBACK_CARRIED_OUT
from trainer.tracking import RunTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReleaseOutcome:
    """What a release did besides publishing."""

    registered: bool = False
    """This version became the registry's candidate (the learner checkpoints it now, so a later
    roll-back to it restores the whole training state)."""
    rolled_back_to: WeightsRef | None = None
    """The champion's weights when the registry rolled the candidate back."""


class Releases:
    """Rank 0's side of a new policy version: :class:`Publisher` puts it out; every
    ``register_every`` versions the registry decides on the candidate first (the off-policy
    gate on the window's rollouts sampled since the candidate, and the monitors), then, unless
    it rolled back, registers this version as the next candidate."""

    def __init__(self, publisher: Publisher, tracker: RunTracker, gate: OffPolicyGate, window: RecentWindow,
                 cfg: DeployConfig, register_every: int, reference: ReferenceScorer | None = None,
                 on_decision: Callable[[dict[str, float], list[str]], None] | None = None) -> None:
        if cfg.monitor_max_kl is not None and reference is None:
            raise ValueError("deploy.monitor_max_kl needs a reference scorer")
        self.reference = reference
        """Scores the KL monitor (None: the monitor is off)."""
        self.publisher = publisher
        self.tracker = tracker
        self.registry = tracker.registry
        self.gate = gate
        self.window = window
        self.cfg = cfg
        self.register_every = register_every
        self.on_decision = on_decision
        """Told the monitors' values and the tripped ones at each decision (the learner's exporter)."""
        self._pinned: set[int] = set()
        """The registry's candidate and champion as last read (:meth:`refresh_pinned`). Kept: a publish
        between registrations asks the registry nothing, as a registry read waits while MLflow does not
        answer (reading them after every publish stopped training one step after the server went away)."""
        self._announced: int | None = None
        """The champion this learner last announced to serving (None: none)."""
        self._champion_read = False
        """Whether the registry's champion was read yet (the first read announces it: a start)."""

    def release(self, state: dict[str, torch.Tensor], version: int, step: int, metrics: dict[str, float],
                reads: tuple[float, float], drift: dict[str, float] | None = None) -> ReleaseOutcome:
        """Publish ``state`` as ``version``; ``reads``: (records read, dead letters) so far;
        ``drift``: the detector's metrics when this version is a restart after a detected
        preference change (:meth:`rebase`)."""
        ref = self.publisher.publish(state, version, step, metrics)
        if drift is not None:
            outcome = self.rebase(ref, metrics, reads, drift, step)
        elif version % self.register_every != 0:
            return ReleaseOutcome()
        else:
            decision, champion = self._decide(reads, step)
            if decision == "rolled_back":
                outcome = ReleaseOutcome(rolled_back_to=champion)
            else:
                self._register(ref, metrics, reads)
                outcome = ReleaseOutcome(registered=True)
        self.publisher.pin(self.refresh_pinned(step))  # the aliases moved: prune what they left
        return outcome

    def _register(self, ref: WeightsRef, metrics: dict[str, float], reads: tuple[float, float]) -> None:
        """``ref`` becomes the registry's candidate; the window marks where its evidence starts."""
        self.registry.register(ref, metrics.get("reward_mean", math.nan))
        self.window.mark_registration(reads)

    def _new_champion(self, ref: WeightsRef, step: int) -> None:
        """Announced on the weights topic: with a canary, serving answers its share with the new
        champion from now on; without one, replicas ignore the notice, and ``online-sao weights hold
        --champion`` reads the champion there (without it the topic named none, or an old one)."""
        self.publisher.announce_champion(ref, step)
        self._announced, self._champion_read = ref.version, True

    def announce_champion_again(self, step: int) -> None:
        """At a learner's start (its first registry read does it: :meth:`refresh_pinned`): the
        registry's champion is announced again. A promotion stopped after the registry recorded it
        and before its notice reached the broker is never decided again (candidate and champion are
        one version), so nothing else would tell serving (or the hold command); a notice of the
        champion serving already has changes nothing there."""
        self._follow_champion(self.registry.champion(), step)

    def _follow_champion(self, champion: tuple[int, WeightsRef] | None, step: int) -> None:
        """Announce the registry's ``champion`` (just read) unless this learner already did: the first
        read is the start's (:meth:`announce_champion_again`); after it, another champion was moved by
        hand (docs/DEPLOY.md). The gate decides against it and pinning keeps it, so serving's canary
        must answer with it too: left on the old one, whose weights pinning then pruned, a restarted
        replica loaded nothing and served no canary share."""
        version, before, moved = None if champion is None else champion[0], self._announced, self._champion_read
        if moved and version == before:
            return
        if champion is not None and champion[0] in self.publisher.store.versions():
            if moved:
                log.warning("registry: the champion alias was moved outside the learner from v%s to v%d: announced "
                            "to serving", before, version)
            self.publisher.announce_champion(champion[1], step)
        elif champion is not None and moved:  # serving could not load it
            log.error("registry: the champion alias was moved outside the learner to v%d, whose weights the store "
                      "does not hold (%s): serving is not told", version, champion[1].location)
        elif moved:
            log.warning("registry: the champion alias was removed outside the learner; serving's canary keeps v%s",
                        before)
        self._announced, self._champion_read = version, True

    def rebase(self, ref: WeightsRef, metrics: dict[str, float], reads: tuple[float, float],
               drift: dict[str, float], step: int = 0) -> ReleaseOutcome:
        """A restart after a detected preference change (trainer/plasticity.py) becomes the champion.

        The champion was chosen on rewards of the old preference, and the detector has just shown
        that the serving policy's reward fell under the new one. Scored on the new traffic, an old
        champion concentrated on the old answers rarely samples what the restarted policy samples:
        its effective sample size stays under the floor and the gate would refuse every candidate
        for the rest of the phase (docs/DEPLOY.md, "After a preference change"). The restart point
        is the starting policy, so from here on candidates are compared with it on the same
        traffic, and a roll-back returns to it, never to the old preference's policy. A candidate
        still pending is superseded. The detector's evidence goes onto the registry version. A
        drift roll-back (``drift_rollback`` in ``drift``: the weights from before the drop, see
        ``drift.rollback_first``) is rebased the same way: it replaces the policy that lost the
        level, whatever the registry had decided about that one."""
        self._register(ref, metrics, reads)
        rolled_back = drift.get("drift_rollback", 0.0) > 0
        evidence = {"gate.decision": "drift_rollback" if rolled_back else "drift_restart",
                    "gate.reason": (f"reward fell by {drift.get('drift_drop', math.nan):.4f} "
                                    f"(z={drift.get('drift_z', math.nan):.2f}): policy "
                                    f"{'rolled back' if rolled_back else 'restarted'}, champion rebased"),
                    **{f"drift.{k.removeprefix('drift_')}": repr(float(v)) for k, v in drift.items()}}
        log.warning("registry: %s v%d is champion after a detected reward drop",
                    "roll-back" if rolled_back else "restart", ref.version)
        self.registry.record_decision("promoted", evidence, ref)
        self._new_champion(ref, step)
        return ReleaseOutcome(registered=True)

    def decide(self, reads: tuple[float, float], step: int = 0) -> Decision:
        """Decide on the registered candidate (if one awaits a decision) and record it with its evidence.
        A tripped monitor rolls back whatever the gate says; without a champion the first
        candidate is promoted unless a monitor tripped (then it stays pending: nothing to return to).
        A champion whose weights the store no longer holds (a lost store), or holds corrupt (a file
        torn by a power loss), counts as none; a candidate whose weights it no longer holds stays
        pending (``candidate_weights_missing``), as does one whose weights are corrupt
        (``candidate_weights_corrupt``). The monitors' values also go to MLflow as
        ``registry_monitor_<name>`` metrics at ``step``.

        A roll-back is recorded in the registry *before* it is announced to serving, tagged
        ``rollback_carried_out=false``: a learner stopped between the two carries it out when it
        starts again (:meth:`rollback_due`). Announced first, a learner stopped before the record
        found the candidate undecided, numbered its next version past the roll-back's notice, and
        serving followed it back onto the rejected policy's line."""
        return self._decide(reads, step)[0]

    def _decide(self, reads: tuple[float, float], step: int) -> tuple[Decision, WeightsRef | None]:
        """:meth:`decide`, and the champion's weights it rolled back to (None unless rolled back)."""
        candidate, champion = self.registry.candidate(), self.registry.champion()
        self._follow_champion(champion, step)
        if candidate is None or (champion is not None and champion[0] == candidate[0]):
            return "pending", None
        scored_against = champion[1] if champion is not None else None  # the alias, whatever the store holds
        held = self.publisher.store.versions()
        if candidate[0] not in held:  # a lost store: nothing to score it with, and serving cannot load it
            log.error("registry: candidate v%d has no weights in the store (%s): left pending; the next "
                      "registration supersedes it", candidate[0], candidate[1].location)
            self.registry.record_decision("pending", {"gate.decision": "candidate_weights_missing"}, candidate[1])
            return "pending", None
        lost = {}
        if champion is not None and champion[0] not in held:
            # nothing to score it with or return to: decided as without a champion, and said so
            log.error("registry: champion v%d has no weights in the store (%s): candidate v%d is decided as "
                      "without a champion", champion[0], champion[1].location, candidate[0])
            lost, champion = {"gate.champion_weights_missing": f"v{champion[0]}"}, None
        try:
            decision, evidence = self._judge(candidate, champion, lost, reads, step)
        except CorruptWeights as exc:  # a file torn by a power loss: it raised at every restart
            if not self._loads(candidate[1]):
                log.error("registry: candidate v%d's weights are corrupt (%s): left pending; the next registration "
                          "supersedes it", candidate[0], exc)
                self.registry.record_decision("pending", {"gate.decision": "candidate_weights_corrupt"}, candidate[1])
                return "pending", None
            if champion is None or self._loads(champion[1]):
                raise
            log.error("registry: champion v%d's weights are corrupt (%s): candidate v%d is decided as without a "
                      "champion", champion[0], exc, candidate[0])
            lost, champion = {"gate.champion_weights_corrupt": f"v{champion[0]}"}, None
            decision, evidence = self._judge(candidate, champion, lost, reads, step)
        log.info("registry: candidate v%d %s (%s)", candidate[0], decision,
                 ", ".join(f"{k}={v}" for k, v in evidence.items()))
        back = champion[1] if decision == "rolled_back" and champion is not None else None
        if back is not None:
            evidence[ROLLBACK_CARRIED_OUT] = "false"  # until its weights go out again (rollback_due)
        if not self.registry.record_decision(decision, evidence, candidate[1], against=scored_against):
            return "pending", None  # an operator moved the champion meanwhile, or deleted the candidate
        if back is not None:  # recorded first: see decide()
            log.warning("candidate rolled back to champion v%d (candidate v%d)", back.version, candidate[0])
            self.publisher.rollback(back, step)
        if decision == "promoted":
            self._new_champion(candidate[1], step)
        return decision, back

    def _judge(self, candidate: tuple[int, WeightsRef], champion: tuple[int, WeightsRef] | None,
               lost: dict[str, str], reads: tuple[float, float], step: int) -> tuple[Decision, dict[str, str]]:
        """The monitors and the gate on ``candidate`` against ``champion`` (None: as without one): the
        decision and its evidence (``lost``: what the evidence says of a champion counted as none)."""
        kl = None if self.reference is None else candidate_kl(self.reference, candidate, self.window)
        monitors = read_monitors(self.cfg, self.window, candidate[0], *reads, kl=kl)
        self.tracker.log_metrics({f"registry_monitor_{k}": v for k, v in monitors.values.items()}, step)
        if self.on_decision is not None:
            self.on_decision(monitors.values, monitors.tripped)
        if champion is None:
            decision: Decision = "pending" if monitors.tripped else "promoted"
            record = self.gate.record_of(candidate[1], self.window)
            return decision, {"gate.decision": "no_champion", **lost, **monitors.tags(),
                              **(record.tags() if record else {})}
        set_aside: dict[str, str] = {}
        gate = self.gate.compare(candidate[1], champion[1], self.window,
                                 lambda: self._champion_record(champion, set_aside))
        decision = "rolled_back" if monitors.tripped else GATE_TO_REGISTRY[gate.decision]
        evidence = {**gate.tags(), **set_aside, **monitors.tags()}
        self._keep_records(gate, decision, evidence, champion[1])
        return decision, evidence

    def _loads(self, ref: WeightsRef) -> bool:
        """Whether ``ref``'s weights load whole (read again only after a load raised CorruptWeights)."""
        try:
            self.publisher.store.load(ref.location, ref.checksum)
        except (CorruptWeights, FileNotFoundError):
            return False
        return True

    def _champion_record(self, champion: tuple[int, WeightsRef], set_aside: dict[str, str]) -> ValueRecord | None:
        """The champion's record, asked for by the gate when it cannot score the champion. One measured
        under other rewards (``reward.*`` changed since) is set aside, said in the log and in
        ``set_aside`` (the decision's evidence). A champion without a usable one (a drift restart, or
        that) gets one measured on the window's rollouts sampled since it, rollouts it was not
        trained on, once that meets the gate's floors (online_sao/gate_record.py)."""
        record = self.registry.champion_record()
        if record is not None and not comparable(record, self.gate.settings):
            log.warning("registry: champion v%d's record was measured under other rewards (reward definition %s; "
                        "the learner's is %s): not decided on. The candidate is decided on the window alone "
                        "until the champion can be scored there, or a record of it is measured on the traffic "
                        "since it (docs/DEPLOY.md)", champion[0], record.reward_definition,
                        self.gate.settings.reward_definition)
            set_aside["gate.record_set_aside"] = f"reward definition {record.reward_definition}"
            record = None
        if record is None and (record := self.gate.record_of(champion[1], self.window)) is not None:
            self.registry.tag_champion(record.tags(), champion[1])
        return record

    def _keep_records(self, gate: GateEvidence, decision: Decision, evidence: dict[str, str],
                      champion: WeightsRef) -> None:
        """A candidate promoted takes its side of the decision as its record (into ``evidence``,
        written onto it); otherwise ``champion``, scored well enough on this window, has its record
        refreshed (online_sao/gate_record.py), if it is still the champion."""
        if decision == "promoted":
            record = candidate_record(gate, self.gate.settings)
            evidence.update(record.tags() if record else {})
        elif (fresh := champion_record(gate, self.gate.settings)) is not None:
            self.registry.tag_champion(fresh.tags(), champion)

    def rollback_due(self) -> WeightsRef | None:
        """The champion to return to, when a roll-back this run recorded was not carried out (the
        learner stopped after the registry recorded it, before the champion's weights went out again
        under the next number: on a restart its checkpoint is the rejected policy's line, which would
        go out next, newer than the champion serving went back to); else None."""
        champion = self.registry.champion() if self.registry.unfinished_rollback() else None
        return None if champion is None else champion[1]

    def rollback_carried_out(self, version: int) -> None:
        """The champion's weights went out again as ``version``: the roll-back is done."""
        self.registry.rollback_carried_out(version)

    def pinned_versions(self) -> set[int]:
        """Policy versions whose checkpoints and weights must stay: the candidate's and the champion's,
        as last read (:meth:`refresh_pinned`); asks the registry nothing (called after every publish)."""
        return set(self._pinned)

    def refresh_pinned(self, step: int = 0) -> set[int]:
        """Read the candidate and the champion again (waiting while MLflow does not answer) and keep them
        as :meth:`pinned_versions`: at start and after each decision or registration, the only times
        this learner moves an alias. A champion moved by hand is announced (:meth:`_follow_champion`)."""
        candidate, champion = self.registry.candidate(), self.registry.champion()
        self._follow_champion(champion, step)
        self._pinned = {found[0] for found in (candidate, champion) if found is not None}
        return set(self._pinned)


GATE_TO_REGISTRY: dict[str, Decision] = {"promoted": "promoted", "rolled_back": "rolled_back",
                                         "undecided": "pending", "refused": "pending"}
"""What the registry does with each gate verdict: an undecided or refused gate moves no alias."""


def release_policy(policy: nn.Module, ctx: DistContext, releases: Releases | None, version: int, step: int,
                   metrics: dict[str, float], reads: tuple[float, float] = (0.0, 0.0),
                   drift: dict[str, float] | None = None) -> ReleaseOutcome:
    """Gather the full policy on rank 0 and release it there (see :class:`Releases`). Collective:
    every rank calls it; ``releases`` is None on ranks other than 0. Returns the outcome on
    every rank (a roll-back target as location and checksum)."""
    state = full_state_dict(policy, ctx)
    shared = None
    if ctx.is_main:
        if releases is None:
            raise ValueError("rank 0 needs its releases")
        outcome = releases.release(state, version, step, metrics, reads, drift)
        back = outcome.rolled_back_to
        shared = [outcome.registered, None if back is None else [back.version, back.location, back.checksum]]
    registered, back = broadcast_json(shared, ctx)
    return ReleaseOutcome(registered, None if back is None else WeightsRef(*back))


def republish(policy: nn.Module, ctx: DistContext, releases: Releases | None, version: int, step: int) -> None:
    """Publish the policy as ``version`` with no registry decision: after a roll-back, the champion's
    restored weights under the learner's next number. Collective, like :func:`release_policy`."""
    state = full_state_dict(policy, ctx)
    if ctx.is_main:
        if releases is None:
            raise ValueError("rank 0 needs its releases")
        releases.publisher.publish(state, version, step)
        releases.publisher.pin(releases.pinned_versions())
