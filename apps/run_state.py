"""Removing the state a run beside the deployment made for itself (``online-sao smoke``,
``online-sao load`` on its own stack), once it passed.

Such a run gets topics, a consumer group, a weight store, checkpoints, a spool and a registered
model of its own (:func:`apps.stack.own_state_overrides`). Left behind, a smoke run in a cron put
four topics and a group on the cluster, and a model directory per registered version into MLflow's
artifacts, every time: registry retention prunes within one registered model, and each run had its
own. What goes: the topics, the group, the registered model with its versions, the model
directories the registrations copied into the run's artifacts, and the run's weights, checkpoints
and spool on disk. What stays: the run's logs and config under its run directory, and its MLflow
experiment with the runs' parameters and metrics (small, and the record of what the check saw).
A run that failed keeps everything, for whoever looks into why; so does ``--keep-state``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kafka.errors import KafkaError
from mlflow.exceptions import MlflowException

from online_sao.config import Config, ConfigError
from online_sao.config.base import mask_uri_password
from streams.base import StreamUnavailable
from trainer.mlflow_store import TrackingUnavailable, is_code

RUN_DIRS = ("weights", "checkpoints", "spool")
"""The run directory's parts :func:`remove_run_state` deletes (``logs`` and the config stay)."""
LEFT_BEHIND = (StreamUnavailable, KafkaError, MlflowException, TrackingUnavailable, ConfigError, OSError)
"""Errors that leave a part of the state (said, not raised): the cluster or MLflow unreachable or
refusing (credentials, ACLs), a file the disk refuses to delete."""


@dataclass(frozen=True)
class RunState:
    """What a run made for itself, read from its own config (the stack's, with its overrides)."""

    topics: tuple[str, ...]
    group: str
    registered_model: str
    experiment: str
    tracking_uri: str
    paths: tuple[Path, ...]

    @classmethod
    def of(cls, cfg: Config, run_dir: Path) -> "RunState":
        """The state ``cfg`` names for the run in ``run_dir``. ValueError when a name is not the run's
        own (``<name>.<run id>``, :func:`apps.stack.own_state_overrides`): given the deployment's config,
        this would delete production's topics, group and registered model."""
        topics = cfg.kafka.topics
        state = cls(topics=(topics.interactions, topics.rewards, topics.weights, topics.dead_letters),
                    group=cfg.trainer.consumer_group, registered_model=cfg.mlflow.registered_model,
                    experiment=cfg.mlflow.experiment, tracking_uri=cfg.mlflow_uri,
                    paths=tuple(run_dir / name for name in RUN_DIRS))
        names = (*state.topics, state.group, state.registered_model, state.experiment)
        if not_the_runs := [name for name in names if not name.endswith(f".{run_dir.name}")]:
            raise ValueError(f"not the state of run {run_dir.name}, not removed: {', '.join(not_the_runs)}")
        return state


def remove_run_state_of(cfg: Config, run_dir: Path, progress: Callable[[str], None] = print) -> list[str]:
    """:func:`remove_run_state` for the run whose config is ``cfg`` (its processes stopped, its broker
    still up), on the cluster and MLflow it names."""
    from streams.kafka_backend import KafkaBackend
    from trainer.mlflow_store import open_client

    return remove_run_state(RunState.of(cfg, run_dir), lambda: KafkaBackend(cfg.kafka),
                            lambda: open_client(cfg.mlflow_uri), progress)


def remove_run_state(state: RunState, kafka: Callable[[], Any], mlflow_client: Callable[[], Any],
                     progress: Callable[[str], None] = print) -> list[str]:
    """Delete ``state`` (module docstring) through ``kafka()`` (a :class:`streams.kafka_backend.KafkaBackend`)
    and ``mlflow_client()``, each made by the part that needs it (an MLflow server that does not answer
    leaves the registry, not the topics). Every part is tried; returns one line per part left, saying
    why (the run's check has passed: what is left is for the operator to delete, not a failed run)."""
    left = []
    parts = (("topics", lambda: _topics(state, kafka())), ("consumer group", lambda: _group(state, kafka())),
             ("registered model", lambda: _registry(state, mlflow_client())), ("files", lambda: _files(state)))
    for part, remove in parts:
        try:
            why = remove()
        except LEFT_BEHIND as exc:  # the next part is tried still
            why = f"{type(exc).__name__}: {mask_uri_password(str(exc))}"
        if why:
            left.append(f"{part} left: {why}")
    removed = "removed" if not left else f"removed but for {len(left)} part(s)"
    progress(f"run state {removed}: topics {', '.join(state.topics)}, consumer group {state.group}, "
             f"registered model {state.registered_model} and its model directories, "
             f"{', '.join(p.name for p in state.paths)} (kept: logs, MLflow experiment {state.experiment})")
    for line in left:
        progress(f"warning: {line}")
    return left


def _topics(state: RunState, kafka) -> str | None:
    refused = kafka.delete_topics(list(state.topics))
    return "; ".join(f"{name} ({why})" for name, why in refused.items()) or None


def _group(state: RunState, kafka) -> str | None:
    refused = kafka.delete_group(state.group)
    return f"{state.group} ({refused})" if refused else None


def _registry(state: RunState, client) -> str | None:
    """The model directories in the artifacts of the experiment's runs, then the registered model
    (MLflow deletes its versions with it; their directories it leaves, hence the first step)."""
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    from trainer.registry_retention import POLICY_DIR

    experiment = client.get_experiment_by_name(state.experiment)
    runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
    for run in runs:
        if any(item.path == POLICY_DIR for item in client.list_artifacts(run.info.run_id)):
            root = f"{run.info.artifact_uri.rstrip('/')}/{POLICY_DIR}"
            get_artifact_repository(root, tracking_uri=state.tracking_uri).delete_artifacts()
    try:
        client.delete_registered_model(state.registered_model)
    except MlflowException as exc:
        if not is_code(exc, RESOURCE_DOES_NOT_EXIST):  # a run that registered nothing
            raise
    return None


def _files(state: RunState) -> str | None:
    for path in state.paths:
        if path.exists():
            shutil.rmtree(path)
    return None
