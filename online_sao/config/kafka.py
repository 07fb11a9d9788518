"""The broker a deployment uses (an existing cluster or the local one) and its topics."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from online_sao.config.base import Section, expand_home


SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI", "AWS_MSK_IAM"]
"""The SASL mechanisms kafka-python knows (``kafka.net.sasl.SASL_MECHANISMS``), spelled as it spells
them: any other name (``scram-sha-512``) failed only when a client first connected."""

SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")


class TopicsConfig(Section):
    interactions: str = "sao.interactions"
    """Topic of completed interactions (rollouts), keyed by interaction id."""
    rewards: str = "sao.rewards"
    """Topic of reward records, keyed by interaction id (co-partitioned with interactions)."""
    weights: str = "sao.weights"
    """Compacted topic of weights notices: published, rollback and (with a canary) champion."""
    dead_letters: str = "sao.dead-letters"
    """Records that failed validation, with the reason."""

    @model_validator(mode="after")
    def _names_differ(self) -> "TopicsConfig":
        # one topic under two names was made once, with one of the two specs (the rewards topic as one
        # compacted partition, say: streams/kafka_backend.py topic_specs), and its readers took each
        # other's records for their own
        by_name: dict[str, list[str]] = {}
        for role in ("interactions", "rewards", "weights", "dead_letters"):
            by_name.setdefault(getattr(self, role), []).append(role)
        clashes = [f"{', '.join(roles[:-1])} and {roles[-1]} are all {name!r}" for name, roles in by_name.items()
                   if len(roles) > 1]
        if clashes:
            raise ValueError(f"every topic needs a name of its own: {'; '.join(clashes)}")
        return self


class KafkaConfig(Section):
    bootstrap_servers: str | None = None
    """An existing cluster (``host:port[,host:port]``). When set it is used as is
    and no local broker is started; when unset, ``online-sao kafka up`` runs one."""
    host: str = "127.0.0.1"
    """Address the local broker listens on (loopback by default)."""
    port: int = Field(19092, ge=1, le=65535)
    """Client port of the local broker."""
    controller_port: int = Field(19093, ge=1, le=65535)
    """KRaft controller port of the local broker."""
    kafka_version: str = "4.4.0"
    """Version of ``org.apache.kafka:kafka_2.13`` resolved from Maven Central."""
    heap_mb: int = Field(512, ge=128)
    """Java heap of the local broker, sized for a small machine."""
    startup_timeout_s: float = Field(90.0, gt=0)
    """How long ``kafka up`` waits for the broker to accept connections."""
    client_timeout_s: float = Field(10.0, gt=0)
    """How long a client waits for the cluster (first connection, metadata of a send,
    an admin request) before the stream backend raises StreamUnavailable."""
    partitions: int = Field(4, ge=1)
    """Partitions of the interactions and rewards topics (same count: co-partitioned)."""
    retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=-1)
    """Retention of interactions, rewards and dead letters (-1 keeps forever)."""
    replication_factor: int = Field(1, ge=1)
    """Replication factor of created topics (1 for the local single node)."""
    topics: TopicsConfig = TopicsConfig()
    """Topic names."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Passed through to kafka-python clients."""
    sasl_mechanism: SaslMechanism | None = None
    """SASL mechanism, as kafka-python names it (exact case): PLAIN, SCRAM-SHA-256, SCRAM-SHA-512,
    OAUTHBEARER, GSSAPI or AWS_MSK_IAM. Required by the SASL protocols (SASL_SSL, SASL_PLAINTEXT);
    with another protocol it, and ``sasl_username``, are refused: the clients would not use them."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: SecretStr | None = None
    """SASL password."""
    ssl_cafile: Path | None = None
    """CA bundle for SSL protocols."""

    _ssl_cafile_home = field_validator("ssl_cafile")(expand_home)
    """``~`` expanded: the path goes to kafka-python as given (streams/kafka_backend.py)."""

    @model_validator(mode="after")
    def _ports_differ(self) -> "KafkaConfig":
        if self.port == self.controller_port:
            raise ValueError("port and controller_port must differ")
        return self

    @model_validator(mode="after")
    def _sasl_fits_the_protocol(self) -> "KafkaConfig":
        if self.security_protocol in SASL_PROTOCOLS:
            if self.sasl_mechanism is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs a sasl_mechanism")
        else:
            given = [name for name in ("sasl_mechanism", "sasl_username") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} set, but security_protocol {self.security_protocol} "
                                 f"does not use SASL (one of {', '.join(SASL_PROTOCOLS)} does)")
        return self

    @property
    def bootstrap(self) -> str:
        """The address clients connect to: the configured cluster or the local broker."""
        return self.bootstrap_servers or f"{self.host}:{self.port}"

    @property
    def is_local(self) -> bool:
        return self.bootstrap_servers is None
