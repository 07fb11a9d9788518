"""One configuration tree for every component of online-sao.

Each component owns one section (a pydantic model, in a module of its own here); every field
has a docstring that says what it controls. Runs are described by YAML files in ``configs/``;
any field can be overridden from the environment with
``ONLINE_SAO__<SECTION>__<FIELD>=value`` (double underscores separate levels; a value is
parsed as YAML, except for a text field, which takes it as written). Unknown keys and invalid values raise
:class:`ConfigError` naming the offending key.

============  ==========================================================
module        sections
============  ==========================================================
``tree``      :class:`Config` (the root), ``paths``, ``model``; loading
``kafka``     ``kafka`` and its ``topics``
``algorithm`` ``algorithm``
``reward``    ``reward``
``serving``   ``serving``
``trainer``   ``trainer``, ``mlflow``
``deploy``    ``deploy``, ``drift``
============  ==========================================================
"""

from online_sao.config.algorithm import AlgorithmConfig
from online_sao.config.base import ConfigError, Section
from online_sao.config.deploy import DeployConfig, DriftConfig
from online_sao.config.kafka import KafkaConfig, TopicsConfig
from online_sao.config.reward import DEFAULT_ID_MEMORY_S, RewardConfig
from online_sao.config.serving import ServingConfig
from online_sao.config.trainer import MLflowConfig, TrainerConfig
from online_sao.config.tree import (ENV_PREFIX, Config, ModelConfig, PathsConfig, dump_config, flat_settings,
                                    load_config)

__all__ = [
    "DEFAULT_ID_MEMORY_S", "ENV_PREFIX", "AlgorithmConfig", "Config", "ConfigError", "DeployConfig",
    "DriftConfig", "KafkaConfig", "MLflowConfig", "ModelConfig", "PathsConfig", "RewardConfig", "Section",
    "ServingConfig", "TopicsConfig", "TrainerConfig", "dump_config", "flat_settings", "load_config",
]
