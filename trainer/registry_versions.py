"""The policy's versions in the MLflow model registry: the aliases it uses, the model directory a
registration copies, and finding a registry version by alias or by the policy it holds.

Stateless operations on an MLflow ``client`` and a registered model's name. The learner's
:class:`trainer.tracking.RunTracker` decides when to call them (registration, the gate's decision)
and waits for a server that does not answer; they are kept apart from its run bookkeeping
(parameters, metrics, the run's lifetime).
"""

from __future__ import annotations

import logging
from pathlib import Path

import fsspec
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from online_sao.config.base import mask_uri_password
from online_sao.weights import CorruptWeights, WeightsRef, sha256_hex
from trainer.mlflow_store import is_code

log = logging.getLogger(__name__)

CANDIDATE = "candidate"
CHAMPION = "champion"
WEIGHTS_FILE = "model.safetensors"
"""Name of the weights inside a registered artifact directory (what transformers loads)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""Endings of the base model's weight files, which a registration replaces with :data:`WEIGHTS_FILE`."""


def ensure_registered_model(client, model_name: str) -> None:
    try:
        client.get_registered_model(model_name)
    except MlflowException as exc:
        if not is_code(exc, RESOURCE_DOES_NOT_EXIST):
            raise
        try:
            client.create_registered_model(model_name, description="online-sao policy versions")
        except MlflowException as again:
            if not is_code(again, RESOURCE_ALREADY_EXISTS):
                raise


def stage_model_directory(ref: WeightsRef, model_dir: Path, directory: Path) -> None:
    """Into ``directory``: the published weights of ``ref`` (checked against its checksum) as
    :data:`WEIGHTS_FILE`, and the files of ``model_dir`` other than its weights and their shard
    index (config, tokenizer, ...)."""
    fs, path = fsspec.core.url_to_fs(ref.location)
    with fs.open(path, "rb") as fh:
        data = fh.read()
    if sha256_hex(data) != ref.checksum:
        raise CorruptWeights(f"{ref.location}: checksum mismatch, not registering version {ref.version}")
    (directory / WEIGHTS_FILE).write_bytes(data)
    for item in sorted(model_dir.iterdir()):
        if item.is_file() and not is_weights_file(item.name):
            (directory / item.name).write_bytes(item.read_bytes())


def unregister(client, model_name: str, ref: WeightsRef, source: str, version: str | None,
               tracking_uri: str) -> None:
    """Undo what a registration of ``ref`` that found no room did: the model directory ``source`` it
    began to copy (nothing refers to it once its registry version is gone: retention would never
    delete it) and registry ``version``, if it was created, without its ``candidate`` alias.
    Deleting frees room, but a full SQLite store may refuse even that: the version is then named,
    and left to retention (no alias: neither the gate nor serving reads it)."""
    parent, name = source.rsplit("/", 1)
    try:
        get_artifact_repository(parent, tracking_uri=tracking_uri).delete_artifacts(name)
    except (MlflowException, OSError) as exc:
        log.warning("registry: the model directory %s of the failed registration of policy v%d is left: %s",
                    source, ref.version, mask_uri_password(str(exc))[:300])
    if version is None:
        return
    try:
        client.delete_model_version(model_name, version)
    except MlflowException as exc:
        log.warning("registry: version %s (policy v%d) was created but never became the candidate; it could "
                    "not be deleted (%s): nothing reads it, retention tags it weights_pruned later",
                    version, ref.version, mask_uri_password(exc.message)[:200])


def is_weights_file(name: str) -> bool:
    """A file of the base model's weights: one of its (sharded) weight files, or a shard index
    (``model.safetensors.index.json``) naming shards that a registered directory, holding the one
    :data:`WEIGHTS_FILE`, does not have (a loader trusting the index would look for them)."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(tuple(s + ".index.json" for s in WEIGHT_SUFFIXES))


def version_with_alias(client, model_name: str, alias: str):
    """The registry version holding ``alias``, or None."""
    try:
        return client.get_model_version_by_alias(model_name, alias)
    except MlflowException as exc:
        # MLflow 3.17 reports an unset alias as INVALID_PARAMETER_VALUE and an
        # unknown registered model as RESOURCE_DOES_NOT_EXIST
        if is_code(exc, INVALID_PARAMETER_VALUE) or is_code(exc, RESOURCE_DOES_NOT_EXIST):
            return None
        raise


def model_versions(client, model_name: str, tag_filter: str | None = None) -> list:
    """The registered model's versions, all pages (those matching ``tags.<tag_filter>``)."""
    tags = "" if tag_filter is None else f" AND tags.{tag_filter}"
    return versions_matching(client, f"name = '{model_name}'{tags}")


def versions_matching(client, query: str) -> list:
    """Every registry version ``query`` (MLflow's model-version search filter) finds, all pages."""
    found, token = [], None
    while True:
        page = client.search_model_versions(query, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            return found


def newest_version_holding(client, model_name: str, ref: WeightsRef):
    """The newest registry version holding ``ref`` (policy version and checksum), or None."""
    holding = [found for found in model_versions(client, model_name) if holds(found, ref)]
    return max(holding, key=lambda found: int(found.version), default=None)


ROLLBACK_CARRIED_OUT = "rollback_carried_out"
"""Registry tag on a rolled-back version: "false" when the roll-back is recorded, then the policy
version that published the champion's weights again. A learner stopped between the two finds
"false" when it starts and carries the roll-back out then (trainer/learner.py)."""


def versions_tagged(client, model_name: str, tag: str, value: str, run_id: str) -> list:
    """The registry versions of ``run_id`` whose ``tag`` is ``value`` (all pages)."""
    return [found for found in model_versions(client, model_name, f"{tag} = '{value}'") if found.run_id == run_id]


POLICY_TAGS = ("policy_version", "weights_location", "checksum")
"""The tags a learner's registration writes on a registry version: what it holds and where it was published."""


def policy_of(found, alias: str) -> tuple[int, WeightsRef] | None:
    """(policy version, where its weights are published) of the registry version ``found``, the one
    holding ``alias``, if any. A version without the learner's :data:`POLICY_TAGS` (the alias set by hand
    on a version registered otherwise), or with a policy version that is no number, counts as none, as a
    champion whose weights the store lost does (trainer/releases.py), and the log says so: the learner can
    neither score it nor publish it."""
    if found is None:
        return None
    problems = [f"no tag {tag}" for tag in POLICY_TAGS if tag not in found.tags]
    try:
        version = None if problems else int(found.tags["policy_version"])
    except ValueError:
        version, problems = None, [f"policy_version {found.tags['policy_version'][:40]!r} is not a number"]
    if version is None:
        log.error("registry: the %s alias is on registry version %s, which holds no policy a learner registered "
                  "(%s): it counts as no %s%s. Point the alias at a version a learner registered, or delete it, "
                  "to end this", alias, found.version, ", ".join(problems), alias,
                  " (the candidate is decided as without one: promoted unless a monitor trips, and the champion "
                  "alias moves to it)" if alias == CHAMPION else "")
        return None
    return version, WeightsRef(version, found.tags["weights_location"], found.tags["checksum"])


def holds(found, ref: WeightsRef) -> bool:
    """The registry version ``found`` holds the published ``ref`` (policy version and checksum)."""
    return found.tags.get("policy_version") == str(ref.version) and found.tags.get("checksum") == ref.checksum
