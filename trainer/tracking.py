"""MLflow tracking and model registry of the learner.

One MLflow run per learner lifetime: the learner stores :attr:`RunTracker.run_id`
in its checkpoint and passes it back after a restart, so metrics continue in the
same run. The default store is a SQLite database under ``data_dir`` (MLflow 3
refuses plain file stores); a server URI works the same way.

Registry: a published policy version is registered by copying its safetensors
file (verified against the published checksum) and the non-weight files of the
model directory (``config.json``, tokenizer, generation config) into the run's
artifacts under ``policy/v<version>``; the registry version's source is that
artifact directory, so ``mlflow.artifacts.download_artifacts("models:/<name>@champion")``
gives a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Tags on the registry version record the policy version, checksum, weight-store
location, and the evidence of the promotion decision.

Promotion: a new registration takes the ``candidate`` alias. The learner decides on it
(:class:`trainer.publisher.Releases`: the off-policy gate and the monitors) and calls
:meth:`RunTracker.record_decision`, which writes the evidence as ``gate.*`` and
``monitor.*`` tags on the candidate's version and moves the aliases: ``champion`` on a
promotion, ``candidate`` back to the champion's version on a roll-back (which the learner
announces to serving).
"""

from __future__ import annotations

import fcntl
import logging
import tempfile
import time
from pathlib import Path
from typing import Literal

import fsspec
import httpx
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)

from online_sao.config import Config, dump_config, flat_settings
from online_sao.gate_record import ValueRecord
from online_sao.weights import CorruptWeights, WeightsRef, sha256_hex

log = logging.getLogger(__name__)

CANDIDATE = "candidate"
CHAMPION = "champion"
WEIGHTS_FILE = "model.safetensors"
"""Name of the weights inside a registered artifact directory (what transformers loads)."""
MAX_PARAM_LENGTH = 6000
"""MLflow's limit on a parameter value; longer values are cut (the full YAML is an artifact)."""
PARAMS_PER_BATCH = 100
"""MLflow accepts at most 100 parameters per log_batch call."""
METRICS_PER_BATCH = 1000
"""MLflow accepts at most 1000 metrics per log_batch call."""

Decision = Literal["promoted", "rolled_back", "pending"]


def flatten_config(cfg: Config) -> dict[str, str]:
    """The resolved configuration as ``section.field`` -> string (secrets masked)."""
    return {key: str(value)[:MAX_PARAM_LENGTH] for key, value in flat_settings(cfg.model_dump(mode="json")).items()}


def _artifact_root(cfg: Config) -> str | None:
    """Where a new experiment keeps artifacts: next to a SQLite store; the server decides otherwise."""
    return (cfg.data_dir / "mlflow-artifacts").as_uri() if cfg.mlflow_uri.startswith("sqlite:") else None


def _is(exc: MlflowException, code: int) -> bool:
    return exc.error_code == ErrorCode.Name(code)


TRACKING_PROBE_S = 10.0
"""How long the first request to an MLflow server may take before it counts as unreachable: MLflow's
own client retries an unreachable server for minutes, deaf to a SIGTERM meanwhile."""


class TrackingUnavailable(RuntimeError):
    """The MLflow server does not answer."""


def probe_server(uri: str, timeout_s: float = TRACKING_PROBE_S) -> None:
    """Ask an MLflow server's ``/health``; TrackingUnavailable, naming the setting, when it does not answer."""
    try:
        httpx.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise TrackingUnavailable(f"MLflow at {uri} (mlflow.tracking_uri) does not answer: {exc}") from None


def open_client(uri: str) -> MlflowClient:
    """An MLflow client on ``uri`` for tracking and the registry. A SQLite store is created
    (directory, tables, migrations) under an exclusive lock on ``<db>.lock``: processes that open
    the same new store at once (seeds run in parallel) otherwise race in MLflow's migrations and
    fail ("Online migration expected to match one row")."""
    if uri.startswith(("http://", "https://")):
        probe_server(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # may create the tables itself
        client.search_experiments(max_results=1)        # creates or checks the tracking tables
        client.search_registered_models(max_results=1)  # and the registry's
    return client


def experiment_id(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment ``name``, created if missing (by whichever process gets there first)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as exc:  # another process created it between our two calls
        if not _is(exc, RESOURCE_ALREADY_EXISTS):
            raise
        return client.get_experiment_by_name(name).experiment_id


class RunTracker:
    """The learner's MLflow run and its registered policy versions (rank 0 only)."""

    def __init__(self, cfg: Config, run_id: str | None = None) -> None:
        self.cfg = cfg
        self.client = open_client(cfg.mlflow_uri)
        self.model_name = cfg.mlflow.registered_model
        self._closed = False
        run = None if run_id is None else self._reopenable(run_id)
        if run is not None:
            self.run_id = run_id
            self._resume(run)
        else:
            self.run_id = self._new_run()
            if run_id is not None:
                self.client.set_tag(self.run_id, "checkpoint_run_missing", run_id)

    # -- run lifetime -----------------------------------------------------------------
    def _new_run(self) -> str:
        experiment = experiment_id(self.client, self.cfg.mlflow.experiment, _artifact_root(self.cfg))
        run = self.client.create_run(experiment, run_name=f"learner-{time.strftime('%Y%m%d-%H%M%S')}",
                                     tags={"component": "learner", "restarts": "0"})
        params = flatten_config(self.cfg)
        self._log_params(run.info.run_id, params)
        self.client.log_text(run.info.run_id, dump_config(self.cfg), "config/resolved.yaml")
        return run.info.run_id

    def _reopenable(self, run_id: str) -> Run | None:
        """The checkpoint's run, if it can be reopened. A tracking store that lost it (a new
        database, a deleted run) is no reason to keep the learner from starting: it logs to a new
        run, tagged ``checkpoint_run_missing`` with the lost id, and says so."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if not _is(exc, RESOURCE_DOES_NOT_EXIST):
                raise
            log.warning("MLflow run %s of the checkpoint does not exist on %s: the learner logs to a new run",
                        run_id, self.cfg.mlflow_uri)
            return None
        if run.info.lifecycle_stage == "deleted":
            log.warning("MLflow run %s of the checkpoint was deleted: the learner logs to a new run", run_id)
            return None
        return run

    def _resume(self, run: Run) -> None:
        """Reopen the run after a restart. Parameters are immutable in MLflow: new keys
        are added, changed values are listed in the ``config_changed`` tag and the
        restart's own YAML is logged next to the first one."""
        restarts = int(run.data.tags.get("restarts", "0")) + 1
        params = flatten_config(self.cfg)
        logged = run.data.params
        self._log_params(self.run_id, {k: v for k, v in params.items() if k not in logged})
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        self.client.log_text(self.run_id, dump_config(self.cfg), f"config/resolved-restart-{restarts}.yaml")
        self.client.set_tag(self.run_id, "restarts", str(restarts))
        if changed:
            self.client.set_tag(self.run_id, f"config_changed.restart-{restarts}", ",".join(changed)[:MAX_PARAM_LENGTH])
        self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[start:start + PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One value per name at ``step`` (NaN is stored as NaN)."""
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(items), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[start:start + METRICS_PER_BATCH])

    def close(self, status: Literal["FINISHED", "FAILED", "KILLED"] = "FINISHED") -> None:
        """End the run (a later restart with the same run id reopens it)."""
        if not self._closed:
            self.client.set_terminated(self.run_id, status)
            self._closed = True

    # -- registry -----------------------------------------------------------------------
    def _ensure_registered_model(self) -> None:
        try:
            self.client.get_registered_model(self.model_name)
        except MlflowException as exc:
            if not _is(exc, RESOURCE_DOES_NOT_EXIST):
                raise
            try:
                self.client.create_registered_model(self.model_name, description="online-sao policy versions")
            except MlflowException as again:
                if not _is(again, RESOURCE_ALREADY_EXISTS):
                    raise

    def _stage_artifact(self, ref: WeightsRef, directory: Path) -> None:
        fs, path = fsspec.core.url_to_fs(ref.location)
        with fs.open(path, "rb") as fh:
            data = fh.read()
        if sha256_hex(data) != ref.checksum:
            raise CorruptWeights(f"{ref.location}: checksum mismatch, not registering version {ref.version}")
        (directory / WEIGHTS_FILE).write_bytes(data)
        for item in sorted(self.cfg.model_dir.iterdir()):
            if item.is_file() and item.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
                (directory / item.name).write_bytes(item.read_bytes())

    def _alias(self, alias: str):
        try:
            return self.client.get_model_version_by_alias(self.model_name, alias)
        except MlflowException as exc:
            # MLflow 3.17 reports an unset alias as INVALID_PARAMETER_VALUE and an
            # unknown registered model as RESOURCE_DOES_NOT_EXIST
            if _is(exc, INVALID_PARAMETER_VALUE) or _is(exc, RESOURCE_DOES_NOT_EXIST):
                return None
            raise

    def register(self, ref: WeightsRef, recent_reward: float) -> str:
        """Register published weights as a new registry version with the ``candidate`` alias.

        ``recent_reward`` is the reward of the policy as known at registration (a tag);
        the promotion decision rests on the evidence passed to :meth:`record_decision`.
        Returns the registry version number (a string, as MLflow numbers them).
        """
        artifact_path = f"policy/v{ref.version:08d}"
        with tempfile.TemporaryDirectory(prefix="online-sao-register-") as tmp:
            self._stage_artifact(ref, Path(tmp))
            self.client.log_artifacts(self.run_id, tmp, artifact_path)
        self._ensure_registered_model()
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        tags = {"policy_version": str(ref.version), "checksum": ref.checksum, "weights_location": ref.location,
                "reward_at_registration": repr(float(recent_reward))}
        version = self.client.create_model_version(self.model_name, source, run_id=self.run_id, tags=tags,
                                                   description=f"policy version {ref.version}")
        self.client.set_registered_model_alias(self.model_name, CANDIDATE, version.version)
        return str(version.version)

    def record_decision(self, decision: Decision, evidence: dict[str, str]) -> None:
        """Write the decision on the ``candidate`` and its ``evidence`` (the gate's and the
        monitors' tags) onto its registry version, then move the aliases: ``promoted`` makes
        it ``champion``; ``rolled_back`` points ``candidate`` back at the champion's version;
        ``pending`` moves nothing (a newer registration supersedes it)."""
        candidate = self._alias(CANDIDATE)
        if candidate is None:
            raise ValueError("no candidate to decide on")
        for key, value in {**evidence, "decision": decision}.items():
            self.client.set_model_version_tag(self.model_name, candidate.version, key, value[:MAX_PARAM_LENGTH])
        if decision == "promoted":
            self.client.set_registered_model_alias(self.model_name, CHAMPION, candidate.version)
        elif decision == "rolled_back":
            champion = self._alias(CHAMPION)
            if champion is None:
                raise ValueError("cannot roll back without a champion")
            self.client.set_registered_model_alias(self.model_name, CANDIDATE, champion.version)

    def candidate(self) -> tuple[int, WeightsRef] | None:
        """(policy version, where its weights are published) of the candidate, if any."""
        return self._policy(self._alias(CANDIDATE))

    def champion(self) -> tuple[int, WeightsRef] | None:
        """(policy version, where its weights are published) of the champion, if any."""
        return self._policy(self._alias(CHAMPION))

    def champion_record(self) -> ValueRecord | None:
        """The champion's record (``record.*`` tags: online_sao/gate_record.py), if it has one."""
        found = self._alias(CHAMPION)
        return None if found is None else ValueRecord.from_tags(found.tags)

    def tag_champion(self, tags: dict[str, str]) -> None:
        """Write ``tags`` onto the champion's registry version (its refreshed record)."""
        champion = self._alias(CHAMPION)
        if champion is None:
            raise ValueError("no champion to tag")
        for key, value in tags.items():
            self.client.set_model_version_tag(self.model_name, champion.version, key, value[:MAX_PARAM_LENGTH])

    @staticmethod
    def _policy(found) -> tuple[int, WeightsRef] | None:
        if found is None:
            return None
        version = int(found.tags["policy_version"])
        return version, WeightsRef(version, found.tags["weights_location"], found.tags["checksum"])

    def registered_policy_versions(self) -> set[int]:
        """Policy versions registered under this model name (the weight store keeps them)."""
        versions: set[int] = set()
        token = None
        while True:
            page = self.client.search_model_versions(f"name = '{self.model_name}'", page_token=token)
            versions.update(int(v.tags["policy_version"]) for v in page if "policy_version" in v.tags)
            token = page.token
            if not token:
                return versions
