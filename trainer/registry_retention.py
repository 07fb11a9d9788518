"""Registry retention: the registered versions' model directories that MLflow keeps.

Each registration copies a whole model directory into the run's artifacts. The newest
``mlflow.keep_registered_artifacts`` of them and those of versions holding an alias (``candidate``,
``champion``, any an operator set) stay; the others are deleted from the artifacts, their registry
versions and tags kept (the deploy decisions' record) and tagged ``weights_pruned=true``.

A registration stopped part way (the learner stopped while the artifact store failed its upload,
or the undo of a refused registration could not delete) leaves a model directory no registry
version refers to. The first pruning of each learner lifetime, and the first after a failed
registration, deletes those of the learner's run that no version of any registered model refers to.
"""

from __future__ import annotations

import logging
import re

from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from trainer.registry_versions import model_versions, versions_matching

log = logging.getLogger(__name__)

WEIGHTS_PRUNED = "weights_pruned"
"""Tag of a registry version: ``false`` while its model directory is in the artifacts, ``true``
once retention deleted it (download it no more; its weights may still be in the weight store)."""
RETENTION_MARKED = "weights_pruned_marked"
"""Tag of the registered model: every version registered before retention existed carries
:data:`WEIGHTS_PRUNED` (set once, by the first learner that prunes)."""


POLICY_DIR = "policy"
"""Where in a run's artifacts each registration copies its model directory."""
MODEL_DIR = re.compile(r"v\d{8}")
"""A model directory's name there (``v<policy version>``): nothing else is retention's to delete."""


def model_artifact_path(policy_version: int) -> str:
    """Where in its run's artifacts the registration of ``policy_version`` copies the model directory."""
    return f"{POLICY_DIR}/v{policy_version:08d}"


class RegistryRetention:
    """Prunes one registered model's artifacts (module docstring) through an MLflow ``client``."""

    def __init__(self, client, model_name: str, keep: int, tracking_uri: str, run_id: str) -> None:
        """``run_id``: the learner's run, whose unregistered model directories are swept."""
        self.client = client
        self.model_name = model_name
        self.keep = keep
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._marked = False
        """Every registered version carries :data:`WEIGHTS_PRUNED` (see :meth:`_mark_unmarked`)."""
        self.sweep_due = True
        """The run may hold a model directory no version refers to (a new lifetime, a failed registration)."""

    def prune(self) -> None:
        """Delete what retention no longer keeps (MLflow's errors propagate: the caller decides)."""
        if self.sweep_due:
            self._sweep_unregistered()
            self.sweep_due = False
        model = self.client.get_registered_model(self.model_name)
        if not self._marked and model.tags.get(RETENTION_MARKED) != "true":
            self._mark_unmarked()
        self._marked = True
        aliased = {str(version) for version in model.aliases.values()}
        stored = sorted(self._search(f"{WEIGHTS_PRUNED} = 'false'"), key=lambda v: int(v.version), reverse=True)
        # a directory two versions share (a registration retried by an older learner) stays while either is kept
        kept = {found.source.rstrip("/") for index, found in enumerate(stored)
                if index < self.keep or str(found.version) in aliased}
        for found in stored[self.keep:]:
            source = found.source.rstrip("/")
            if str(found.version) in aliased or source in kept:
                continue
            if not source.endswith("/" + model_artifact_path(int(found.tags.get("policy_version", -1)))):
                continue  # not a directory this learner copied: not ours to delete
            parent, name = source.rsplit("/", 1)
            get_artifact_repository(parent, tracking_uri=self.tracking_uri).delete_artifacts(name)
            self.client.set_model_version_tag(self.model_name, found.version, WEIGHTS_PRUNED, "true")
            log.info("registry: the model directory of version %s (policy v%s) deleted from the artifacts",
                     found.version, found.tags.get("policy_version"))

    def _sweep_unregistered(self) -> None:
        """Delete the run's model directories that no registry version refers to (module docstring).
        Called only between registrations: the learner registers one at a time."""
        root = f"{self.client.get_run(self.run_id).info.artifact_uri.rstrip('/')}/{POLICY_DIR}"
        # by name within the run: a source written under another form of the store's address still counts;
        # every registered model's versions: a run resumed under another mlflow.registered_model (or a
        # version an operator registered from it) still refers to the directories of the first
        referenced = {found.source.rstrip("/").rsplit("/", 1)[-1]
                      for found in versions_matching(self.client, f"run_id = '{self.run_id}'")
                      if found.run_id == self.run_id}
        for item in self.client.list_artifacts(self.run_id, POLICY_DIR):
            name = item.path.rsplit("/", 1)[-1]
            if item.is_dir and MODEL_DIR.fullmatch(name) and name not in referenced:
                get_artifact_repository(root, tracking_uri=self.tracking_uri).delete_artifacts(name)
                log.warning("registry: deleted %s/%s from the artifacts: a registration stopped part way left it "
                            "and no registry version refers to it", root, name)

    def _mark_unmarked(self) -> None:
        """Tag ``weights_pruned=false`` on versions registered before retention existed (once for
        the registered model: the registry is read whole), so that pruning finds them by the tag."""
        for found in self._search():
            if WEIGHTS_PRUNED not in found.tags and "policy_version" in found.tags:
                self.client.set_model_version_tag(self.model_name, found.version, WEIGHTS_PRUNED, "false")
        self.client.set_registered_model_tag(self.model_name, RETENTION_MARKED, "true")

    def _search(self, tag_filter: str | None = None) -> list:
        """The registered model's versions, all pages (those matching ``tags.<tag_filter>``)."""
        return model_versions(self.client, self.model_name, tag_filter)
