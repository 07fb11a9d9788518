"""MLflow tracking and model registry of the learner.

One MLflow run per learner lifetime: the learner stores :attr:`RunTracker.run_id`
in its checkpoint and passes it back after a restart, so metrics continue in the
same run. The default store is a SQLite database under ``data_dir`` (MLflow 3
refuses plain file stores); a server URI works the same way.

Registry (:mod:`trainer.registry_versions`): a published policy version is registered
by copying its safetensors file (verified against the published checksum) and the
non-weight files of the model directory (``config.json``, tokenizer, generation
config) into the run's artifacts under ``policy/v<version>``; the registry version's
source is that artifact directory, so ``mlflow.artifacts.download_artifacts("models:/<name>@champion")``
gives a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Tags on the registry version record the policy version, checksum, weight-store
location, and the evidence of the promotion decision.

Retention (:meth:`RunTracker.prune_registered`, trainer/registry_retention.py): after each
registration the model directories of older versions without an alias leave the artifacts.

Metrics: :meth:`RunTracker.log_step` gathers the learner's cycles and logs them every
``mlflow.log_every_steps`` steps (:class:`~trainer.step_window.StepWindow`), with the run tags that
changed (which label each segment slot shows: online_sao/segments.py); :meth:`RunTracker.log_metrics` logs at once.

Promotion: a new registration takes the ``candidate`` alias. The learner decides on it
(:class:`trainer.publisher.Releases`: the off-policy gate and the monitors) and calls
:meth:`RunTracker.record_decision`, which writes the evidence as ``gate.*`` and
``monitor.*`` tags on the candidate's version and moves the aliases: ``champion`` on a
promotion, ``candidate`` back to the champion's version on a roll-back (which the learner
announces to serving).

An MLflow server that goes away mid-run (bounded requests: :func:`bound_mlflow_requests`), a SQLite
store another writer holds locked past its busy timeout (MLflow's TEMPORARILY_UNAVAILABLE), or the
run or its experiment deleted by an operator (:func:`~trainer.mlflow_store.deleted_run`: said once, at
ERROR, with how to restore it): the learner keeps training and keeps the steps' metrics, sent once
the server answers again (the run is restored); a
registry call waits for the server, and a stop request ends that wait with
:class:`TrackingUnavailable`. Without a stop event (one-shot callers) nothing waits.

A store with no room (its disk full: MLflow's SQLite "database or disk is full", an artifact write's
ENOSPC), or whose disk fails its writes otherwise (SQLite's "disk I/O error", a full quota among
them): metrics are kept as during an outage and sent once it takes them again; opening the run,
a registration and the gate's decision fail at once with an ``OSError`` (ENOSPC, EIO) naming the
file (:func:`~trainer.mlflow_store.store_refused`), which stops the learner like its other full
disks. A registration that fails so deletes the model directory it had begun to copy, and
the registry version if one was created without its ``candidate`` alias: no half-registered
version is left for the gate or serving to use, nor a partial directory holding space.
"""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

from mlflow.entities import Metric, Param, Run, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from online_sao.config import Config, dump_config, flat_settings
from online_sao.durable import is_disk_full, naming_the_file
from online_sao.gate_record import ValueRecord
from online_sao.reachable import until_reachable
from online_sao.weights import WeightsRef
from trainer.mlflow_store import (RunDeleted, TrackingUnavailable, artifact_root, artifacts_named, deleted_run,
                                  disk_refused, experiment_id, is_code, is_temporarily_unavailable, is_unreachable,
                                  open_client, store_refused, unavailable)
from trainer.registry_retention import WEIGHTS_PRUNED, RegistryRetention, model_artifact_path
from trainer.registry_versions import (CANDIDATE, CHAMPION, ROLLBACK_CARRIED_OUT, ensure_registered_model, holds,
                                       newest_version_holding, policy_of, stage_model_directory, unregister,
                                       version_with_alias, versions_tagged)
from trainer.step_window import StepWindow, Unsent

log = logging.getLogger(__name__)

MAX_PARAM_LENGTH = 6000
"""MLflow's limit on a parameter value; longer values are cut (the full YAML is an artifact)."""
PARAMS_PER_BATCH = 100
"""MLflow accepts at most 100 parameters per log_batch call."""

Decision = Literal["promoted", "rolled_back", "pending"]


def flatten_config(cfg: Config) -> dict[str, str]:
    """The resolved configuration as ``section.field`` -> string (secrets masked)."""
    return {key: str(value)[:MAX_PARAM_LENGTH] for key, value in flat_settings(cfg.model_dump(mode="json")).items()}


TRACKING_RETRY_S = 5.0
"""Pause between two attempts while the MLflow server does not answer (a registry call waits; the
metrics are sent at the next step at least this long after the last failure)."""
UNLOGGED_STEPS_MAX = 10_000
"""Logged steps of metrics kept while MLflow does not answer (the oldest are dropped beyond, and
counted); a logged step covers ``mlflow.log_every_steps`` learner steps."""


def _waiting(what: str):
    """A registry method that waits for an MLflow server that does not answer (``RunTracker._answered``)."""
    def wrap(method):
        @functools.wraps(method)
        def waiting(self: RunTracker, *args, **kwargs):
            return self._answered(what, lambda: method(self, *args, **kwargs))
        return waiting
    return wrap


class RunTracker:
    """The learner's MLflow run and its registered policy versions (rank 0 only)."""

    def __init__(self, cfg: Config, run_id: str | None = None, stop: threading.Event | None = None) -> None:
        self.cfg = cfg
        self.stop = stop
        """Set by the learner's stop request: ends a wait for an MLflow server that does not answer
        (None: nothing waits)."""
        self.model_name = cfg.mlflow.registered_model
        self._closed = False
        self._unlogged = Unsent(UNLOGGED_STEPS_MAX)
        """Logged steps of metrics (and run tags) MLflow did not take yet (it did not answer, or had no room)."""
        self._unlogged_why: Exception | None = None
        """Why MLflow did not take them (TrackingUnavailable, or an OSError naming its store that refused a write)."""
        self._next_metrics_try = 0.0
        self._window = StepWindow()
        self.resumed_tags: dict[str, str] = {}
        """The run's tags when the learner reopened it after a restart (empty for a new run)."""
        self._pruning_refused = False
        """The artifact store refused a deletion: retention is off until the learner restarts."""
        self._creating: WeightsRef | None = None
        """The weights whose registry version was asked for and not yet given its alias: a retry
        looks for that version first, as the server may have made it without answering."""
        self._opening: tuple[Run, int] | None = None
        """The run being opened and its restart count (0: a new run), once created or read: a retry of
        the opening (an answer lost) goes on with them, neither creating a second run nor counting
        the restart twice."""
        self._run_token: str | None = None
        """The ``learner_start`` tag of the run this start asked MLflow to create: a retry looks for that
        run first, as the server may have made it without answering."""
        self.client = self._answered("opening the MLflow store", lambda: open_client(cfg.mlflow_uri))
        self._answered("opening the learner's MLflow run", lambda: self._open_run(run_id))
        self.retention = RegistryRetention(self.client, self.model_name, cfg.mlflow.keep_registered_artifacts,
                                           cfg.mlflow_uri, self.run_id)

    def _answered(self, what: str, action, wait: bool = True):
        """``action()``; while the server does not answer, waited for (see the module docstring)
        if ``wait``, else TrackingUnavailable at once."""
        def attempt():
            try:
                return action()
            except MlflowException as exc:
                if (refused := store_refused(exc, self.cfg.mlflow_uri)) is not None:
                    raise refused from exc  # not waited for: room is made by someone, not by time
                if not (is_unreachable(exc) or is_temporarily_unavailable(exc, self.cfg.mlflow_uri)):
                    raise
                raise unavailable(exc, self.cfg.mlflow_uri) from exc
        if self.stop is None or not wait:
            return attempt()
        return until_reachable(attempt, what, (TrackingUnavailable,), TRACKING_RETRY_S, self.stop)

    def _open_run(self, run_id: str | None) -> None:
        """Open the checkpoint's run ``run_id`` (or a new one). Retried whole while the store does not
        answer: the run created or read by an earlier attempt, and the restart count read then, are
        kept (:attr:`_opening`), and the steps after it are each the same again (parameters of the same
        value, the same artifact, tags and status)."""
        if self._opening is None:
            run = None if run_id is None else self._reopenable(run_id)
            if run is not None:
                self.resumed_tags = dict(run.data.tags)
                self._opening = (run, int(run.data.tags.get("restarts", "0")) + 1)
            else:
                self._opening = (self._create_run(), 0)
        run, restarts = self._opening
        self.run_id = run.info.run_id
        if restarts:
            self._resume(run, restarts)
        else:
            self._set_up_new_run(run)
            if run_id is not None:
                self.client.set_tag(self.run_id, "checkpoint_run_missing", run_id)
        self._opening = None

    # -- run lifetime -----------------------------------------------------------------
    def _create_run(self) -> Run:
        """A new run in the experiment, tagged ``learner_start`` with a token of this start: a retry
        after a lost answer takes the run the store made, if it did, rather than make a second."""
        experiment = experiment_id(self.client, self.cfg.mlflow.experiment, artifact_root(self.cfg))
        if self._run_token is not None:
            found = self.client.search_runs([experiment], f"tags.learner_start = '{self._run_token}'", max_results=1)
            if found:
                return found[0]
        else:
            self._run_token = uuid.uuid4().hex
        return self.client.create_run(experiment, run_name=f"learner-{time.strftime('%Y%m%d-%H%M%S')}",
                                      tags={"component": "learner", "restarts": "0",
                                            "learner_start": self._run_token})

    def _set_up_new_run(self, run: Run) -> None:
        params = flatten_config(self.cfg)
        self._log_params(run.info.run_id, params)
        with artifacts_named(f"{run.info.artifact_uri}/config"):
            self.client.log_text(run.info.run_id, dump_config(self.cfg), "config/resolved.yaml")

    def _reopenable(self, run_id: str) -> Run | None:
        """The checkpoint's run, if it can be reopened. A tracking store that lost it (a new
        database, a deleted run) is no reason to keep the learner from starting: it logs to a new
        run, tagged ``checkpoint_run_missing`` with the lost id, and says so."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if not is_code(exc, RESOURCE_DOES_NOT_EXIST):
                raise
            log.warning("MLflow run %s of the checkpoint does not exist on %s: the learner logs to a new run",
                        run_id, self.cfg.mlflow_uri)
            return None
        if run.info.lifecycle_stage == "deleted":
            log.warning("MLflow run %s of the checkpoint was deleted: the learner logs to a new run", run_id)
            return None
        return run

    def _resume(self, run: Run, restarts: int) -> None:
        """Reopen the run (as read before this restart's first write to it) after a restart, the
        ``restarts``-th. Parameters are immutable in MLflow: new keys are added, changed values are
        listed in the ``config_changed`` tag and the restart's own YAML is logged next to the first one."""
        params = flatten_config(self.cfg)
        logged = run.data.params
        self._log_params(self.run_id, {k: v for k, v in params.items() if k not in logged})
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        with artifacts_named(f"{run.info.artifact_uri}/config"):
            self.client.log_text(self.run_id, dump_config(self.cfg), f"config/resolved-restart-{restarts}.yaml")
        self.client.set_tag(self.run_id, "restarts", str(restarts))
        if changed:
            self.client.set_tag(self.run_id, f"config_changed.restart-{restarts}", ",".join(changed)[:MAX_PARAM_LENGTH])
        self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[start:start + PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int, tags: dict[str, str] | None = None) -> None:
        """One value per name at ``step`` (NaN is stored as NaN), and run ``tags`` set. Never waits for the
        server: while it does not answer they are kept and sent, in order, once it does."""
        now = int(time.time() * 1000)
        self._unlogged.add([Metric(k, float(v), now, step) for k, v in metrics.items()], tags or {})
        if time.monotonic() >= self._next_metrics_try:
            self._send_unlogged()

    def log_step(self, step: int, averaged: dict[str, float], latest: dict[str, float],
                 tags: dict[str, str] | None = None) -> None:
        """One learner cycle's metrics and run tags, logged at every ``mlflow.log_every_steps``-th step
        with the cycles since (:class:`StepWindow`: the mean of ``averaged``, the newest ``latest``,
        the ``tags`` whose newest value changed); the rest at :meth:`close`."""
        self._window.add(step, averaged, latest, tags)
        if step % self.cfg.mlflow.log_every_steps == 0:
            self._log_window()

    def _log_window(self) -> None:
        taken = self._window.take()
        if taken is not None:
            self.log_metrics(taken.metrics, step=taken.step, tags=taken.tags)

    @property
    def unlogged_steps(self) -> int:
        """Steps of metrics waiting for the server to answer."""
        return len(self._unlogged.logs)

    def _send_unlogged(self) -> None:
        failing = self._unlogged_why is not None  # the last try failed: said once, at the first
        try:
            self._unlogged.send(self.client, self.run_id)
        except MlflowException as exc:
            refused = store_refused(exc, self.cfg.mlflow_uri)
            outage = is_unreachable(exc) or is_temporarily_unavailable(exc, self.cfg.mlflow_uri)
            deleted = None if refused is not None or outage else deleted_run(self.client, self.run_id, exc)
            if refused is None and not outage and deleted is None:
                raise
            # a store that refuses writes loses nothing kept here either: the learner trains on, and a write it
            # cannot go on without (the registry's, a checkpoint on the same disk) stops it; a run deleted by hand
            # stops no training either (metrics are a side channel): kept until it is restored
            newly_deleted = deleted is not None and not isinstance(self._unlogged_why, RunDeleted)
            self._unlogged_why = refused or deleted or unavailable(exc, self.cfg.mlflow_uri)
            if newly_deleted:
                log.error("%s; the learner goes on and keeps each step's metrics to send once it can", deleted)
            elif not failing and refused is not None:
                log.warning("MLflow's store cannot write to its disk: %s; the learner goes on and keeps each step's "
                            "metrics to send once it can", refused)
            elif not failing:
                log.warning("%s; the learner goes on and keeps each step's metrics to send when it can",
                            self._unlogged_why)
            self._next_metrics_try = time.monotonic() + TRACKING_RETRY_S
            return
        if failing:
            self._unlogged_why = None
            log.info("MLflow takes metrics again: those it missed are logged (%d steps dropped)",
                     self._unlogged.dropped)

    def close(self, status: Literal["FINISHED", "FAILED", "KILLED"] = "FINISHED") -> None:
        """Send the metrics kept during an outage and end the run (a later restart with the same
        run id reopens it). A server that still does not answer after a stop request, or a store
        still without room, is named in the log, with what it missed, and the run is left as it is
        (never raised: closing is in the learner's ``finally``, whose error it would hide)."""
        if self._closed:
            return
        self._log_window()  # the steps since the last log (kept like any other during an outage)
        try:
            self._answered("sending the kept metrics", self._send_all_unlogged, wait=False)
            self._answered("ending the MLflow run", lambda: self.client.set_terminated(self.run_id, status),
                           wait=False)
        except (TrackingUnavailable, OSError) as exc:
            if not isinstance(exc, TrackingUnavailable) and not disk_refused(exc):
                raise
            log.warning("%s; the run %s stays open, %d steps of metrics not logged", exc, self.run_id,
                        self.unlogged_steps + self._unlogged.dropped)
        except MlflowException as exc:  # MLflow's own refusal (a run deleted by hand): said, not raised (above)
            log.error("ending the MLflow run %s failed: %s; %d steps of metrics not logged", self.run_id,
                      exc.message[:300], self.unlogged_steps + self._unlogged.dropped)
        self._closed = True

    def _send_all_unlogged(self) -> None:
        self._next_metrics_try = 0.0
        self._send_unlogged()
        if self.unlogged_steps:
            raise self._unlogged_why

    # -- registry -----------------------------------------------------------------------
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
            self._answered("pruning the registered artifacts", self.retention.prune, wait=False)
        except TrackingUnavailable as exc:
            log.warning("%s; the registered artifacts are pruned at the next registration", exc)
        except OSError as exc:  # requests.HTTPError is one: the proxied server answered with a refusal
            if is_disk_full(exc):  # deleting is what makes room: tried again at the next registration
                log.warning("registry retention could not record its pruning: %s; the registered artifacts "
                            "are pruned at the next registration", exc)
                return
            self._pruning_refused = True
            log.warning("registry retention is off until the learner restarts: the artifact store refused to "
                        "delete a registered model directory (%s: %s); MLflow's artifacts keep one model per "
                        "registration meanwhile", type(exc).__name__, str(exc)[:300])

    @_waiting("recording the gate's decision")
    def record_decision(self, decision: Decision, evidence: dict[str, str], decided: WeightsRef) -> None:
        """Write the decision and its ``evidence`` (the gate's and the monitors' tags) onto the
        registry version of ``decided``, the policy the gate scored, then move the aliases:
        ``promoted`` makes it ``champion``; ``rolled_back`` points ``candidate`` back at the
        champion's version; ``pending`` moves nothing (a newer registration supersedes it).

        The version is the one ``candidate`` points at when it holds ``decided`` (policy version
        and checksum), else the newest registry version that does: a second writer on the same
        registered model (an old pod overlapping a new one) may have moved ``candidate`` while the
        gate scored, and its registration must not get this verdict. A roll-back then leaves
        ``candidate`` on that newer registration."""
        candidate = version_with_alias(self.client, self.model_name, CANDIDATE)
        target = (candidate if candidate is not None and holds(candidate, decided)
                  else newest_version_holding(self.client, self.model_name, decided))
        if target is None:
            raise ValueError(f"policy version {decided.version} ({decided.checksum}) is not registered")
        moved = target is not candidate
        if moved:
            log.warning("registry: the candidate alias moved to registry version %s while policy v%d was decided; "
                        "the decision goes onto v%d's registry version %s", None if candidate is None else
                        candidate.version, decided.version, decided.version, target.version)
        for key, value in {**evidence, "decision": decision}.items():
            self.client.set_model_version_tag(self.model_name, target.version, key, value[:MAX_PARAM_LENGTH])
        if decision == "promoted":
            self.client.set_registered_model_alias(self.model_name, CHAMPION, target.version)
        elif decision == "rolled_back":
            champion = version_with_alias(self.client, self.model_name, CHAMPION)
            if champion is None:
                raise ValueError("cannot roll back without a champion")
            if not moved:
                self.client.set_registered_model_alias(self.model_name, CANDIDATE, champion.version)

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
        champion = version_with_alias(self.client, self.model_name, CHAMPION)
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
        return policy_of(version_with_alias(self.client, self.model_name, CHAMPION), CHAMPION)

    @_waiting("reading the champion's record")
    def champion_record(self) -> ValueRecord | None:
        """The champion's record (its ``record`` tag: online_sao/gate_record.py), if it has one."""
        found = version_with_alias(self.client, self.model_name, CHAMPION)
        return None if found is None else ValueRecord.from_tags(found.tags)

    @_waiting("tagging the champion")
    def tag_champion(self, tags: dict[str, str]) -> None:
        """Write ``tags`` onto the champion's registry version (its refreshed record), one registry
        call each, in ``tags``' order (a record's ``record`` tag last: online_sao/gate_record.py)."""
        champion = version_with_alias(self.client, self.model_name, CHAMPION)
        if champion is None:
            raise ValueError("no champion to tag")
        for key, value in tags.items():
            self.client.set_model_version_tag(self.model_name, champion.version, key, value[:MAX_PARAM_LENGTH])
