"""The whole tree: its sections, and reading it from YAML, the environment and overrides."""

from __future__ import annotations

import os
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from online_sao.config.algorithm import AlgorithmConfig
from online_sao.config.base import ConfigError, Section
from online_sao.config.deploy import DeployConfig, DriftConfig
from online_sao.config.kafka import KafkaConfig
from online_sao.config.reward import RewardConfig
from online_sao.config.serving import ServingConfig
from online_sao.config.trainer import MLflowConfig, TrainerConfig

ENV_PREFIX = "ONLINE_SAO__"


class PathsConfig(Section):
    data_dir: Path = Path("data")
    """Root for everything the service writes locally: broker data, models, spool,
    weights, checkpoints, MLflow database. Relative paths resolve against the
    working directory."""


class ModelConfig(Section):
    path: Path | None = None
    """A local Hugging Face model directory to serve and train. When unset the
    project's default model is built (once, cached) under data_dir/models/base."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of serving, of the published weights and of the gate's scoring. The learner
    keeps float32 weights and optimiser state whatever this says (AdamW's small steps round away in
    bfloat16) and publishes them cast to it."""


class Config(Section):
    paths: PathsConfig = PathsConfig()
    """Where local state lives."""
    kafka: KafkaConfig = KafkaConfig()
    """Broker and topics."""
    model: ModelConfig = ModelConfig()
    """Which model is served and trained."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Learning rule."""
    reward: RewardConfig = RewardConfig()
    """Reward validation and joining."""
    serving: ServingConfig = ServingConfig()
    """HTTP endpoint."""
    trainer: TrainerConfig = TrainerConfig()
    """Learner loop."""
    mlflow: MLflowConfig = MLflowConfig()
    """Experiment tracking and registry."""
    deploy: DeployConfig = DeployConfig()
    """Promotion gate and monitors of the registry."""
    drift: DriftConfig = DriftConfig()
    """Detecting a preference switch and restarting the learner's exploration."""

    @property
    def data_dir(self) -> Path:
        return self.paths.data_dir.expanduser().resolve()

    @property
    def model_dir(self) -> Path:
        return (self.model.path or self.data_dir / "models" / "base").expanduser().resolve()

    @property
    def spool_dir(self) -> Path:
        return (self.serving.spool_dir or self.data_dir / "spool").expanduser().resolve()

    @property
    def weight_store_url(self) -> str:
        return self.trainer.weight_store or str(self.data_dir / "weights")

    @property
    def checkpoint_dir(self) -> Path:
        return (self.trainer.checkpoint_dir or self.data_dir / "checkpoints").expanduser().resolve()

    @property
    def mlflow_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.data_dir / 'mlflow.db'}"


C = TypeVar("C", bound="Config")


TEXT_TYPES = (str, SecretStr, Path)
"""Field types whose environment value is taken as written: parsed as YAML, a password ``p@ss #1``
lost its comment-like tail, ``#x`` became null, ``123456`` a number the field refuses."""


def _load_yaml(text: str) -> Any:
    """The document in ``text``, read by :class:`UniqueKeyLoader` (a safe loader: plain data only)."""
    loader = UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping: the last one won, so a
    second ``serving:`` section silently replaced the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": merged below, where an explicit key wins as YAML says
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # a list as a key: the safe loader's own error, below
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _field_type(schema: type[BaseModel], keys: list[str]) -> Any:
    """The annotation of the field at ``keys`` under ``schema`` (None for a key it does not have)."""
    model: Any = schema
    annotation = None
    for key in keys:
        field = model.model_fields.get(key) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        annotation = model = field.annotation
    return annotation


YAML_NULLS = frozenset({"null", "Null", "NULL", "~"})
"""What unsets an optional text field (``--set model.path=null``), as in YAML."""


def _text_field(annotation: Any) -> tuple[bool, bool]:
    """(a text field, or an optional one (``str | None``); whether it may be None)."""
    union = get_origin(annotation) in (Union, UnionType)
    options = [a for a in get_args(annotation) if a is not type(None)] if union else [annotation]
    return len(options) == 1 and options[0] in TEXT_TYPES, union and type(None) in get_args(annotation)


def _apply_env(raw: dict[str, Any], environ: Mapping[str, str], schema: type[BaseModel]) -> dict[str, Any]:
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX):].split("__") if k]
        if not keys:
            continue
        _section(raw, keys[:-1], name)[keys[-1]] = setting_value(schema, keys, value, name)
    return raw


def setting_value(schema: type[BaseModel], keys: list[str], text: str, source: str) -> Any:
    """The value a setting written as text (an environment variable, ``--set``) gives the field at
    ``keys``: None for an empty one, the text itself for a text field (:data:`TEXT_TYPES`; a YAML
    null unsets an optional one), else YAML (``[a, b]`` is a list). A YAML error names ``source``
    and where, not the text: it may be a secret."""
    if text == "":
        return None
    is_text, optional = _text_field(_field_type(schema, keys))
    if is_text:
        return None if optional and text in YAML_NULLS else text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{source}: not a YAML value{where}") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where (1-based line and column), without its quote of the
    offending line: that line may hold a secret (an unclosed quote around a password)."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML refuses
        return f"{exc.reason} (character {exc.position + 1})"
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    parts = [f"{text}{_yaml_where(mark)}" for text, mark in ((exc.context, exc.context_mark),
                                                              (exc.problem, exc.problem_mark)) if text]
    return ": ".join(parts) or type(exc).__name__


def _yaml_where(mark: yaml.Mark | None) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _section(raw: dict[str, Any], keys: list[str], source: str) -> dict[str, Any]:
    """The mapping at ``keys`` under ``raw``, made where missing; a section a YAML file left empty
    (every line under it commented out) is an empty one. ConfigError naming ``source`` when a key on
    the way holds a value, not a section."""
    node = raw
    for depth, key in enumerate(keys):
        if node.get(key) is None:
            node[key] = {}
        if not isinstance(node[key], dict):
            raise ConfigError(f"{source}: {'.'.join(keys[:depth + 1])} is not a section")
        node = node[key]
    return node


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{key}: {msg}")
    return "invalid configuration: " + "; ".join(lines)


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, schema: type[C] = Config) -> C:  # type: ignore[assignment]
    """Read a YAML file (optional), apply environment and explicit overrides, validate against
    ``schema`` (the core tree, or an application's extension of it such as ``apps.config.AppConfig``)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"configuration file not found: {path}")
        try:
            loaded = _load_yaml(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw = loaded or {}
    raw = _apply_env(raw, os.environ if environ is None else environ, schema)
    for dotted, value in (overrides or {}).items():
        *parents, last = dotted.split(".")
        _section(raw, parents, f"override {dotted}")[last] = value
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def dump_config(cfg: Config, reveal_secrets: bool = False) -> str:
    """The resolved configuration as YAML; secrets are masked unless ``reveal_secrets``
    (used to hand a resolved configuration to a child process through a private file)."""
    data = cfg.model_dump(mode="json")
    if reveal_secrets:
        _reveal(cfg, data)
    return yaml.safe_dump(data, sort_keys=False)


def flat_settings(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``section.field`` -> value of every leaf of a nested mapping (a configuration's JSON dump: secrets
    masked); a list is a leaf, an empty mapping has none."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(flat_settings(value, path))
        else:
            flat[path] = value
    return flat


def _reveal(model: BaseModel, data: dict[str, Any]) -> None:
    for name in type(model).model_fields:
        data[name] = _revealed(getattr(model, name), data[name])


def _revealed(value: Any, dumped: Any) -> Any:
    """``dumped`` (``value``'s JSON dump) with every secret in it in clear: in sections, lists and
    mappings alike (``serving.source_keys`` maps a source to a list of keys), and a URL's password
    (masked by its section's serializer: ``mlflow.tracking_uri``)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if type(value) is str:  # a text dumps as itself, but for the password a serializer masked
        return value
    if isinstance(value, BaseModel):
        _reveal(value, dumped)
        return dumped
    if isinstance(value, (list, tuple)):
        return [_revealed(v, d) for v, d in zip(value, dumped)]
    if isinstance(value, Mapping):
        return {key: _revealed(v, d) for (_, v), (key, d) in zip(value.items(), dumped.items())}
    return dumped
