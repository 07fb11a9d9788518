"""The learner's registered policy versions in MLflow's model registry (rank 0 only).

Registry (:mod:`trainer.registry_versions`): a published policy version is registered
by copying its safetensors file (verified against the published checksum) and the
non-weight files of the model directory (``config.json``, tokenizer, generation
config) into the run's artifacts under ``policy/v<version>``; the registry version's
source is that artifact directory, so ``mlflow.artifacts.download_artifacts("models:/<name>@champion")``
gives a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Tags on the registry version record the policy version, checksum, weight-store
location, and the evidence of the promotion decision.

Retention (:meth:`PolicyRegistry.prune_registered`, trainer/registry_retention.py): after each
registration the model directories of older versions without an alias leave the artifacts.

Promotion: a new registration takes the ``candidate`` alias. The learner decides on it
(:class:`trainer.releases.Releases`: the off-policy gate and the monitors) and calls
:meth:`PolicyRegistry.record_decision`, which writes the evidence as ``gate.*`` and
``monitor.*`` tags on the candidate's version and moves the aliases: ``champion`` on a
promotion, ``candidate`` back to the champion's version on a roll-back (which the learner
announces to serving).


An MLflow server that does not answer: each registry call waits for it (the tracker's stop event ends
the wait with :class:`TrackingUnavailable`), as trainer/tracking.py describes with the store's other
faults; a store with no room fails a registration at once, which deletes what it had begun to copy.
"""
from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from online_sao.config import Config
from online_sao.config.base import mask_uri_password
from online_sao.durable import is_disk_full, naming_the_file
from online_sao.gate_record import ValueRecord
from online_sao.weights import WeightsRef
from trainer.mlflow_store import MAX_VALUE_LENGTH, TrackingUnavailable, artifacts_named, disk_refused, store_refused
from trainer.registry_retention import WEIGHTS_PRUNED, RegistryRetention, model_artifact_path
from trainer.registry_versions import (CANDIDATE, CHAMPION, ROLLBACK_CARRIED_OUT, ensure_registered_model, holds,
                                       newest_version_holding, policy_of, stage_model_directory, unregister,
                                       version_with_alias, versions_tagged)

log = logging.getLogger(__name__)

Decision = Literal["promoted", "rolled_back", "pending"]

UNCHECKED = object()
"""``record_decision``'s ``against`` when no champion is to be checked (a drift restart's own
promotion, a candidate left pending for its weights)."""

Answered = Callable[..., object]
"""``answered(what, action, wait=True)``: ``action()``, waiting while the MLflow server does not answer
(:meth:`trainer.tracking.RunTracker._answered`)."""


def _waiting(what: str):
    """A registry method that waits for an MLflow server that does not answer (``PolicyRegistry.answered``)."""
    def wrap(method):
        @functools.wraps(method)
        def waiting(self: PolicyRegistry, *args, **kwargs):
            return self.answered(what, lambda: method(self, *args, **kwargs))
        return waiting
    return wrap


class PolicyRegistry:
    """The registered model ``mlflow.registered_model``: the learner run ``run_id``'s policy versions,
    the ``candidate`` and ``champion`` aliases and the gate's decisions on them."""

    def __init__(self, client: MlflowClient, cfg: Config, run_id: str, answered: Answered) -> None:
        self.client = client
        self.cfg = cfg
        self.run_id = run_id
        self.answered = answered
        self.model_name = cfg.mlflow.registered_model
        self.retention = RegistryRetention(client, self.model_name, cfg.mlflow.keep_registered_artifacts,
                                           cfg.mlflow_uri, run_id)
        self._pruning_refused = False
        """The artifact store refused a deletion: retention is off until the learner restarts."""
        self._creating: WeightsRef | None = None
        """The weights whose registry version was asked for and not yet given its alias: a retry
        looks for that version first, as the server may have made it without answering."""

    def register(self, ref: WeightsRef, recent_reward: float) -> str:
        """Register published weights as a new registry version with the ``candidate`` alias, then
        prune the artifacts of older versions (:meth:`prune_registered`).

        ``recent_reward`` is the reward of the policy as known at registration (a tag);
        the promotion decision rests on the evidence passed to :meth:`record_decision`.
        Returns the registry version number (a string, as MLflow numbers them).
        """
        version = self._register(ref, recent_reward)
        self.prune_registered()
        return version

    @_waiting("registering a policy version")
    def _register(self, ref: WeightsRef, recent_reward: float) -> str:
        artifact_path = model_artifact_path(ref.version)
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        if self._creating == ref:  # a retry: the server may have made the version and not answered
            found = newest_version_holding(self.client, self.model_name, ref)
            if found is not None and found.run_id == self.run_id:
                self.client.set_registered_model_alias(self.model_name, CANDIDATE, found.version)
                self._creating = None
                return str(found.version)
        version = None
        try:
            with tempfile.TemporaryDirectory(prefix="online-sao-register-") as tmp:
                with naming_the_file(tmp):
                    stage_model_directory(ref, self.cfg.model_dir, Path(tmp))
                with artifacts_named(source):
                    self.client.log_artifacts(self.run_id, tmp, artifact_path)
            ensure_registered_model(self.client, self.model_name)
            tags = {"policy_version": str(ref.version), "checksum": ref.checksum, "weights_location": ref.location,
                    "reward_at_registration": repr(float(recent_reward)), WEIGHTS_PRUNED: "false"}
            self._creating = ref
            version = self.client.create_model_version(self.model_name, source, run_id=self.run_id, tags=tags,
                                                       description=f"policy version {ref.version}").version
            self.client.set_registered_model_alias(self.model_name, CANDIDATE, version)
            self._creating = None
        except (MlflowException, OSError) as exc:
            self.retention.sweep_due = True  # the copy may be left part way
            if disk_refused(exc) or (isinstance(exc, MlflowException)
                                       and store_refused(exc, self.cfg.mlflow_uri) is not None):
                unregister(self.client, self.model_name, ref, source, version, self.cfg.mlflow_uri)
            raise
        return str(version)

    def prune_registered(self) -> None:
        """Delete the model directories of registered versions other than the newest
        ``mlflow.keep_registered_artifacts`` and those holding an alias, and tag their versions
        ``weights_pruned=true`` (the versions and their other tags stay). Never waits: an MLflow
        server that does not answer leaves it to the next registration. An artifact store that
        refuses a deletion (an HTTP error from a proxied server, a file it may not remove) is
        named in one warning, and retention stays off until the learner restarts; training goes on."""
        if self._pruning_refused:
            return
        try:
            self.answered("pruning the registered artifacts", self.retention.prune, wait=False)
        except TrackingUnavailable as exc:
            log.warning("%s; the registered artifacts are pruned at the next registration", exc)
        except OSError as exc:  # requests.HTTPError is one: the proxied server answered with a refusal
            if is_disk_full(exc):  # deleting is what makes room: tried again at the next registration
                log.warning("registry retention could not record its pruning: %s; the registered artifacts "
                            "are pruned at the next registration", mask_uri_password(str(exc)))
                return
            self._pruning_refused = True
            log.warning("registry retention is off until the learner restarts: the artifact store refused to "
                        "delete a registered model directory (%s: %s); MLflow's artifacts keep one model per "
                        "registration meanwhile", type(exc).__name__, mask_uri_password(str(exc))[:300])

    @_waiting("recording the gate's decision")
    def record_decision(self, decision: Decision, evidence: dict[str, str], decided: WeightsRef,
                        against: WeightsRef | None | object = UNCHECKED) -> bool:
        """Write the decision and its ``evidence`` (the gate's and the monitors' tags) onto the
        registry version of ``decided``, the policy the gate scored, then move the aliases:
        ``promoted`` makes it ``champion``; ``rolled_back`` points ``candidate`` back at the
        champion's version; ``pending`` moves nothing (a newer registration supersedes it).
        Returns whether the decision stands (False: nothing moves, nor may anything follow from it).

        ``against``: the champion the gate scored ``decided`` against (None: there was none). When the
        ``champion`` alias no longer holds it, an operator moved (or deleted) it while the gate scored:
        the verdict is set aside, written as ``pending`` with ``gate.set_aside`` saying why, and False
        returned. Before, a promotion scored against the old champion undid the operator's roll-back,
        and a roll-back to it undid their promotion. ``decided`` no longer registered (deleted by
        hand meanwhile) writes nothing and returns False; it stopped the learner.

        The version is the one ``candidate`` points at when it holds ``decided`` (policy version
        and checksum), else the newest registry version that does: a second writer on the same
        registered model (an old pod overlapping a new one) may have moved ``candidate`` while the
        gate scored, and its registration must not get this verdict. A roll-back then leaves
        ``candidate`` on that newer registration."""
        candidate = version_with_alias(self.client, self.model_name, CANDIDATE)
        target = (candidate if candidate is not None and holds(candidate, decided)
                  else newest_version_holding(self.client, self.model_name, decided))
        if target is None:
            log.warning("registry: policy v%d (%s) is no longer registered (deleted while it was decided): its "
                        "decision, %s, is not recorded", decided.version, decided.checksum, decision)
            return False
        stands = True
        now = self._champion_version() if against is not UNCHECKED else None
        own_move = decision == "promoted" and now is not None and holds(now, decided)  # a retry of this call
        if against is not UNCHECKED and not own_move and (why := _champion_moved(now, against)):
            log.warning("registry: candidate v%d %s set aside: %s; left pending (the next registration supersedes "
                        "it, decided against the champion of now)", decided.version, decision, why)
            # nothing to carry out: a roll-back set aside left as "not carried out" rolled back at the next start
            evidence = {k: v for k, v in evidence.items() if k != ROLLBACK_CARRIED_OUT}
            decision, evidence, stands = "pending", {**evidence, "gate.set_aside": why}, False
        moved = target is not candidate
        if moved:
            log.warning("registry: the candidate alias moved to registry version %s while policy v%d was decided; "
                        "the decision goes onto v%d's registry version %s", None if candidate is None else
                        candidate.version, decided.version, decided.version, target.version)
        for key, value in {**evidence, "decision": decision}.items():
            self.client.set_model_version_tag(self.model_name, target.version, key, value[:MAX_VALUE_LENGTH])
        if decision == "promoted":
            self.client.set_registered_model_alias(self.model_name, CHAMPION, target.version)
        elif decision == "rolled_back":
            champion = now if against is not UNCHECKED else self._champion_version()  # read above when checked
            if champion is None:
                raise ValueError("cannot roll back without a champion")
            if not moved:
                self.client.set_registered_model_alias(self.model_name, CANDIDATE, champion.version)
        return stands

    def _champion_version(self):
        return version_with_alias(self.client, self.model_name, CHAMPION)

    @_waiting("reading for a roll-back not carried out")
    def unfinished_rollback(self) -> bool:
        """Whether a roll-back this run recorded was not carried out: its restored weights never went
        out (:meth:`rollback_carried_out`; ``ROLLBACK_CARRIED_OUT`` is "false" on the rolled-back version)."""
        return bool(versions_tagged(self.client, self.model_name, ROLLBACK_CARRIED_OUT, "false", self.run_id))

    @_waiting("recording a roll-back carried out")
    def rollback_carried_out(self, version: int) -> None:
        """The roll-backs this run recorded went out as policy ``version`` (the champion's weights again)."""
        for found in versions_tagged(self.client, self.model_name, ROLLBACK_CARRIED_OUT, "false", self.run_id):
            self.client.set_model_version_tag(self.model_name, found.version, ROLLBACK_CARRIED_OUT, f"v{version}")

    @_waiting("reading the candidate")
    def candidate(self) -> tuple[int, WeightsRef] | None:
        """(policy version, where its weights are published) of the candidate, if any. A roll-back
        recorded without its alias move is finished first (:meth:`_finished_rollback`)."""
        candidate = self._finished_rollback(version_with_alias(self.client, self.model_name, CANDIDATE))
        return policy_of(candidate, CANDIDATE)

    def _finished_rollback(self, candidate):
        """``candidate`` (the registry version holding the ``candidate`` alias), unless it was already
        decided ``rolled_back``: a learner stopped inside :meth:`record_decision`, after the decision's
        tags and before the alias moved, left it there, where the next decision would take it for an
        undecided candidate and could promote it. The move is finished here (``candidate`` back to the
        champion's version, which is returned) and said in the log; without a champion to move it to,
        the rejected version counts as no candidate (None)."""
        if candidate is None or candidate.tags.get("decision") != "rolled_back":
            return candidate
        champion = self._champion_version()
        if champion is not None and champion.version == candidate.version:
            return candidate  # the champion itself (an operator promoted a rejected version): nothing to move
        if champion is None:
            log.error("registry: the candidate alias is on registry version %s (policy v%s), already rolled back, "
                      "and there is no champion to move it back to: it counts as no candidate", candidate.version,
                      candidate.tags.get("policy_version"))
            return None
        log.warning("registry: the candidate alias was left on registry version %s (policy v%s), rolled back by a "
                    "learner stopped before moving it: moved back to the champion's registry version %s (policy "
                    "v%s)", candidate.version, candidate.tags.get("policy_version"), champion.version,
                    champion.tags.get("policy_version"))
        self.client.set_registered_model_alias(self.model_name, CANDIDATE, champion.version)
        return champion

    @_waiting("reading the champion")
    def champion(self) -> tuple[int, WeightsRef] | None:
        """(policy version, where its weights are published) of the champion, if any."""
        return policy_of(self._champion_version(), CHAMPION)

    @_waiting("reading the champion's record")
    def champion_record(self) -> ValueRecord | None:
        """The champion's record (its ``record`` tag: online_sao/gate_record.py), if it has one."""
        found = self._champion_version()
        return None if found is None else ValueRecord.from_tags(found.tags)

    @_waiting("tagging the champion")
    def tag_champion(self, tags: dict[str, str], scored: WeightsRef | None = None) -> None:
        """Write ``tags`` onto the champion's registry version (its refreshed record), one registry
        call each, in ``tags``' order (a record's ``record`` tag last: online_sao/gate_record.py).
        ``scored``: the champion the record was measured on; when the alias no longer holds it (an
        operator moved or deleted it meanwhile) nothing is written: the record is not the new
        champion's (it was written onto it; without a champion the learner stopped)."""
        champion = self._champion_version()
        if scored is not None and (why := _champion_moved(champion, scored)):
            log.warning("registry: the record measured on champion v%d is not written: %s", scored.version, why)
            return
        if champion is None:
            raise ValueError("no champion to tag")
        for key, value in tags.items():
            self.client.set_model_version_tag(self.model_name, champion.version, key, value[:MAX_VALUE_LENGTH])


def _champion_moved(now, scored: WeightsRef | None) -> str | None:
    """Why the registry version ``now`` holding the ``champion`` alias (None: no alias) is not the
    champion ``scored`` (None: there was none), or None when it is."""
    if (now is None and scored is None) or (now is not None and scored is not None and holds(now, scored)):
        return None
    was = "no champion" if scored is None else f"policy v{scored.version}"
    is_now = "none" if now is None else f"policy v{now.tags.get('policy_version')} (registry version {now.version})"
    return f"the champion alias moved while it was decided, outside the learner: it was {was}, it is {is_now}"
