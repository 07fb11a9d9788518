"""MLflow tracking and model registry of the learner.

One MLflow run per learner lifetime: the learner stores :attr:`RunTracker.run_id`
in its checkpoint and passes it back after a restart, so metrics continue in the
same run. The default store is a SQLite database under ``data_dir`` (MLflow 3
refuses plain file stores); a server URI works the same way.

Registry (:class:`trainer.registry.PolicyRegistry`, :attr:`RunTracker.registry`): the run's
registered policy versions, their aliases and the gate's decisions.

Metrics: :meth:`RunTracker.log_step` gathers the learner's cycles and logs them every
``mlflow.log_every_steps`` steps (:class:`~trainer.step_window.StepWindow`), with the run tags that
changed (which label each segment slot shows: online_sao/segments.py); :meth:`RunTracker.log_metrics` logs at once.

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

A server that refuses the credentials (HTTP 401) or their user (HTTP 403) stops the learner with a
one-line ConfigError naming ``mlflow.tracking_uri``, its password masked
(:func:`~trainer.mlflow_store.credentials_refused`): nothing waits, as time does not mend them.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import yaml

from mlflow.entities import Metric, Param, Run, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from online_sao.config import Config, ConfigError, dump_config, flat_settings
from online_sao.config.base import mask_uri_password
from online_sao.reachable import until_reachable
from trainer.mlflow_store import (MAX_VALUE_LENGTH, RunDeleted, TrackingUnavailable, artifact_root, artifacts_named,
                                  credentials_refused, deleted_run, disk_refused, experiment_id, is_code,
                                  is_temporarily_unavailable, is_unreachable, open_client, store_refused, unavailable)
from trainer.registry import PolicyRegistry
from trainer.step_window import StepWindow, Unsent

log = logging.getLogger(__name__)

PARAMS_PER_BATCH = 100
"""MLflow accepts at most 100 parameters per log_batch call."""


def flatten_config(cfg: Config) -> dict[str, str]:
    """The resolved configuration as ``section.field`` -> string (secrets masked)."""
    return {key: str(value)[:MAX_VALUE_LENGTH] for key, value in flat_settings(cfg.model_dump(mode="json")).items()}


def changed_settings_tag(previous: dict[str, str], current: dict[str, str]) -> str:
    """The ``config_changed.restart-N`` tag's value: ``key: old -> new`` for each setting whose value
    differs from ``previous`` (settings new to the run are left out), separated by ``; ``; only the keys,
    comma-separated (cut to :data:`MAX_VALUE_LENGTH`), when the values do not fit in a tag. Empty: none
    changed."""
    changed = sorted(k for k, v in current.items() if k in previous and previous[k] != v)
    with_values = "; ".join(f"{k}: {previous[k]} -> {current[k]}" for k in changed)
    if len(with_values) <= MAX_VALUE_LENGTH:
        return with_values
    return ",".join(changed)[:MAX_VALUE_LENGTH]


TRACKING_RETRY_S = 5.0
"""Pause between two attempts while the MLflow server does not answer (a registry call waits; the
metrics are sent at the next step at least this long after the last failure)."""
UNLOGGED_STEPS_MAX = 10_000
"""Logged steps of metrics kept while MLflow does not answer (the oldest are dropped beyond, and
counted); a logged step covers ``mlflow.log_every_steps`` learner steps."""


class RunTracker:
    """The learner's MLflow run and its registered policy versions (rank 0 only)."""

    def __init__(self, cfg: Config, run_id: str | None = None, stop: threading.Event | None = None) -> None:
        self.cfg = cfg
        self.stop = stop
        """Set by the learner's stop request: ends a wait for an MLflow server that does not answer
        (None: nothing waits)."""
        self._closed = False
        self._unlogged = Unsent(UNLOGGED_STEPS_MAX)
        """Logged steps of metrics (and run tags) MLflow did not take yet (it did not answer, or had no room)."""
        self._unlogged_why: Exception | None = None
        """Why MLflow did not take them (TrackingUnavailable, or an OSError naming its store that refused a write)."""
        self._next_metrics_try = 0.0
        self._window = StepWindow()
        self.resumed_tags: dict[str, str] = {}
        """The run's tags when the learner reopened it after a restart (empty for a new run)."""
        self._opening: tuple[Run, int] | None = None
        """The run being opened and its restart count (0: a new run), once created or read: a retry of
        the opening (an answer lost) goes on with them, neither creating a second run nor counting
        the restart twice."""
        self._run_token: str | None = None
        """The ``learner_start`` tag of the run this start asked MLflow to create: a retry looks for that
        run first, as the server may have made it without answering."""
        self.client = self._answered("opening the MLflow store", lambda: open_client(cfg.mlflow_uri))
        self._answered("opening the learner's MLflow run", lambda: self._open_run(run_id))
        self.registry = PolicyRegistry(self.client, cfg, self.run_id, self._answered)
        """The run's registered policy versions, their aliases and the gate's decisions."""

    def _answered(self, what: str, action, wait: bool = True):
        """``action()``; while the server does not answer, waited for (see the module docstring)
        if ``wait``, else TrackingUnavailable at once."""
        def attempt():
            try:
                return action()
            except MlflowException as exc:
                if (refused := store_refused(exc, self.cfg.mlflow_uri)) is not None:
                    raise refused from exc  # not waited for: room is made by someone, not by time
                if (refused := credentials_refused(exc, self.cfg.mlflow_uri)) is not None:
                    raise refused from exc  # nor are new credentials
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
                        run_id, mask_uri_password(self.cfg.mlflow_uri))
            return None
        if run.info.lifecycle_stage == "deleted":
            log.warning("MLflow run %s of the checkpoint was deleted: the learner logs to a new run", run_id)
            return None
        return run

    def _resume(self, run: Run, restarts: int) -> None:
        """Reopen the run (as read before this restart's first write to it) after a restart, the
        ``restarts``-th. Parameters are immutable in MLflow (they keep the first lifetime's values):
        new keys are added, the restart's own YAML is logged next to the first one, and the settings
        that differ from the previous lifetime's (its YAML) are listed in the
        ``config_changed.restart-N`` tag, with their values (:func:`changed_settings_tag`)."""
        params = flatten_config(self.cfg)
        logged = run.data.params
        self._log_params(self.run_id, {k: v for k, v in params.items() if k not in logged})
        previous = self._previous_settings(run, restarts)
        with artifacts_named(f"{run.info.artifact_uri}/config"):
            self.client.log_text(self.run_id, dump_config(self.cfg), f"config/resolved-restart-{restarts}.yaml")
        self.client.set_tag(self.run_id, "restarts", str(restarts))
        if tag := changed_settings_tag(previous, params):
            self.client.set_tag(self.run_id, f"config_changed.restart-{restarts}", tag)
        self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))

    def _previous_settings(self, run: Run, restarts: int) -> dict[str, str]:
        """The settings of the lifetime before the ``restarts``-th restart: the newest resolved YAML of
        the run logged by an earlier lifetime (one small artifact read; a retried opening may have
        logged this restart's already). The run's parameters (the first lifetime's) if it has none.
        The tag only informs: an artifact store that fails (its own errors, not MLflow's) or a YAML that
        does not read falls back to the parameters, with a warning, rather than stopping the start."""
        try:
            logged = {info.path for info in self.client.list_artifacts(self.run_id, "config")}
            earlier = [f"config/resolved-restart-{n}.yaml" for n in range(restarts - 1, 0, -1)]
            newest = next((name for name in [*earlier, "config/resolved.yaml"] if name in logged), None)
            if newest is None:
                return dict(run.data.params)
            with tempfile.TemporaryDirectory() as tmp:
                tree = yaml.safe_load(Path(self.client.download_artifacts(self.run_id, newest, tmp)).read_text())
        except (MlflowException, OSError, yaml.YAMLError) as exc:  # requests' errors are OSErrors
            if isinstance(exc, MlflowException) and (is_unreachable(exc) or
                                                     is_temporarily_unavailable(exc, self.cfg.mlflow_uri)):
                raise  # an outage: waited out like any other call of the start
            log.warning("the previous lifetime's settings could not be read (%s): config_changed.restart-%d "
                        "compares with the first lifetime's", mask_uri_password(str(exc))[:300], restarts)
            return dict(run.data.params)
        if not isinstance(tree, dict):
            log.warning("the previous lifetime's settings are not a mapping: config_changed.restart-%d compares "
                        "with the first lifetime's", restarts)
            return dict(run.data.params)
        return {key: str(value)[:MAX_VALUE_LENGTH] for key, value in flat_settings(tree).items()}

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
            if (credentials := credentials_refused(exc, self.cfg.mlflow_uri)) is not None:
                raise credentials from exc  # not kept for later, as for an outage: no time mends it
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
        except ConfigError as exc:  # the server refused the credentials: said, not raised (above)
            log.error("%s; the run %s stays open, %d steps of metrics not logged", exc, self.run_id,
                      self.unlogged_steps + self._unlogged.dropped)
        except MlflowException as exc:  # MLflow's own refusal (a run deleted by hand): said, not raised (above)
            log.error("ending the MLflow run %s failed: %s; %d steps of metrics not logged", self.run_id,
                      mask_uri_password(exc.message)[:300], self.unlogged_steps + self._unlogged.dropped)
        self._closed = True

    def _send_all_unlogged(self) -> None:
        self._next_metrics_try = 0.0
        self._send_unlogged()
        if self.unlogged_steps:
            raise self._unlogged_why
