"""The local broker and the ``kafka up|down|status`` functions, against real JVMs.

Broker starts are expensive on a small machine: besides the session broker, only
``test_up_status_down_up_keeps_records`` starts full brokers (two starts, one data dir).
"""

from __future__ import annotations

import io
import shutil
import socket
import threading

import pytest

from online_sao.config import KafkaConfig
from online_sao.schemas import DeadLetter, Interaction, Reward, WeightsNotice, decode
from streams.base import StreamUnavailable, TopicsMisconfigured
from streams.broker import LocalBroker
from streams.broker_cli import kafka_down, kafka_status, kafka_up
from streams.kafka_backend import KafkaBackend
from streams.records import publish
from tests.conftest import _free_port
from tests.fixtures.kafka import drain, local_broker_config, share_jars


def _run(fn, cfg) -> tuple[int, str]:
    out = io.StringIO()
    rc = fn(cfg, out=out)
    return rc, out.getvalue()


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_server_properties_describe_a_single_loopback_kraft_node(tmp_path):
    cfg = local_broker_config(tmp_path)
    props = dict(line.split("=", 1) for line in LocalBroker(cfg).server_properties().splitlines())
    k = cfg.kafka
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{k.port},CONTROLLER://127.0.0.1:{k.controller_port}"
    assert props["controller.quorum.voters"] == f"1@127.0.0.1:{k.controller_port}"
    assert props["log.dirs"] == str(tmp_path.resolve() / "kafka" / "data")
    assert props["auto.create.topics.enable"] == "false"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["transaction.state.log.replication.factor"] == "1"


def test_a_failed_start_shows_the_last_lines_of_a_long_log(tmp_path):
    """The log is appended to at every start and never rotated: its end is read, not all of it."""
    broker = LocalBroker(local_broker_config(tmp_path))
    broker.log_file.parent.mkdir(parents=True, exist_ok=True)
    broker.log_file.write_text("".join(f"line {k} {'x' * 200}\n" for k in range(20_000)))  # about 4 MB
    tail = broker._log_tail().splitlines()
    assert len(tail) == 20 and tail[-1].startswith("line 19999 ") and tail[0].startswith("line 19980 ")
    broker.log_file.unlink()
    assert broker._log_tail() == ""


@pytest.mark.parametrize("which", ["port", "controller_port"])
def test_a_port_in_use_is_named_in_one_clear_error(tmp_path, which):
    cfg = local_broker_config(tmp_path)
    port = getattr(cfg.kafka, which)
    with _listening(port):
        rc, out = _run(kafka_up, cfg)
    assert rc == 1
    assert out.startswith(f"error: port {port} on 127.0.0.1 is already in use (kafka.{which})")
    assert not (tmp_path / "kafka" / "broker.pid").exists()


def test_missing_java_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    rc, out = _run(kafka_up, local_broker_config(tmp_path))
    assert rc == 1
    assert out.startswith("error: java not found on PATH: the local Kafka broker needs Java 17+")


def test_missing_maven_is_a_clear_error(tmp_path, monkeypatch):
    java_only = tmp_path / "java-only"
    java_only.mkdir()
    (java_only / "java").symlink_to(shutil.which("java"))
    monkeypatch.setenv("PATH", str(java_only))
    rc, out = _run(kafka_up, local_broker_config(tmp_path / "data"))
    assert rc == 1
    assert out.startswith("error: mvn not found on PATH: the local Kafka broker needs Maven")


@pytest.mark.kafka
def test_resolved_jars_are_reused_without_maven(tmp_path, kafka_lib_dir, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mvn: a second resolve must not need it
    cfg = local_broker_config(tmp_path)
    assert LocalBroker(cfg, lib_dir=kafka_lib_dir).resolve_jars() == kafka_lib_dir
    jars = {p.name for p in kafka_lib_dir.glob("*.jar")}
    version = cfg.kafka.kafka_version
    assert {f"kafka_2.13-{version}.jar", f"kafka-clients-{version}.jar", "log4j-slf4j2-impl-2.26.1.jar"} <= jars
    assert any(name.startswith("slf4j-api-2.") for name in jars)  # the 1.7 API would not bind log4j2


@pytest.mark.kafka
def test_a_broker_that_is_not_up_in_time_is_stopped_and_its_log_shown(tmp_path, kafka_lib_dir):
    cfg = local_broker_config(tmp_path, **{"kafka.startup_timeout_s": 0.5})
    share_jars(cfg, kafka_lib_dir)
    rc, out = _run(kafka_up, cfg)
    assert rc == 1
    assert "error: the broker did not accept connections within 0.5 s (kafka.startup_timeout_s)" in out
    assert "---- last lines of the broker log ----" in out
    assert "==== online-sao: starting broker" in out
    assert LocalBroker(cfg).pid() is None
    assert not (tmp_path / "kafka" / "broker.pid").exists()


@pytest.mark.kafka
def test_up_status_down_up_keeps_records(tmp_path, kafka_lib_dir):
    """The issue's acceptance path through the CLI functions, in a fresh data dir (the jars
    are the session's: Maven ran for them once in kafka_lib_dir)."""
    cfg = local_broker_config(tmp_path)
    share_jars(cfg, kafka_lib_dir)
    t = cfg.kafka.topics
    records = {
        t.interactions: Interaction(interaction_id="i-1", model="m", prompt_ids=[1], response_ids=[2, 3],
                                    action_mask=[True, True], logprobs=[-0.1, -0.2], versions=[0, 0]),
        t.rewards: Reward(interaction_id="i-1", value=1.0),
        t.weights: WeightsNotice(version=1, location="/w/1", checksum="c" * 64),
        t.dead_letters: DeadLetter(raw=b"??", source_topic=t.rewards, reason="not a JSON record"),
    }
    try:
        rc, out = _run(kafka_up, cfg)
        assert rc == 0, out
        assert f"bootstrap: 127.0.0.1:{cfg.kafka.port}" in out
        assert f"log: {tmp_path.resolve() / 'kafka' / 'broker.log'}" in out
        print(out.splitlines()[0])  # the measured start time, visible with -s

        backend = KafkaBackend(cfg.kafka)
        producer = backend.producer()
        for topic, record in records.items():
            publish(producer, topic, record)
        publish(producer, t.rewards, Reward(interaction_id="i-2", value=-1.0))
        producer.flush(10)
        producer.close()
        group = backend.consumer([t.rewards], group_id="restart-group")
        first = drain(group, 2)
        done = next(m for m in first if decode(m.value).interaction_id == "i-1")
        group.commit({done.tp: done.offset + 1})
        group.close()

        rc, out = _run(kafka_up, cfg)
        assert rc == 0 and "already running" in out

        rc, out = _run(kafka_status, cfg)
        assert rc == 0, out
        assert "Kafka: running" in out and f"bootstrap: 127.0.0.1:{cfg.kafka.port}" in out
        assert f"  {t.interactions}  partitions={cfg.kafka.partitions}" in out
        assert f"  {t.weights}  partitions=1" in out

        rc, out = _run(kafka_down, cfg)
        assert (rc, out) == (0, "Kafka broker stopped\n")
        assert "Beginning controlled shutdown" in (tmp_path / "kafka" / "broker.log").read_text()
        rc, out = _run(kafka_status, cfg)
        assert rc == 1 and "Kafka: not running" in out
        rc, out = _run(kafka_down, cfg)
        assert (rc, out) == (0, "Kafka broker is not running\n")

        rc, out = _run(kafka_up, cfg)
        assert rc == 0, out
        print(out.splitlines()[0])
        consumer = KafkaBackend(cfg.kafka).consumer(list(records))
        got = {m.topic: decode(m.value) for m in drain(consumer, 4) if decode(m.value).kind != "reward"
               or decode(m.value).interaction_id == "i-1"}
        consumer.close()
        assert got == records
        resumed = KafkaBackend(cfg.kafka).consumer([t.rewards], group_id="restart-group")
        rest = drain(resumed, 1)
        assert [decode(m.value).interaction_id for m in rest] == ["i-2"]
        assert resumed.poll(timeout_s=0.5) == []
        resumed.close()
    finally:
        LocalBroker(cfg).stop()
    assert LocalBroker(cfg).pid() is None


@pytest.mark.kafka
def test_a_configured_cluster_is_used_as_is(tmp_path, kafka_broker):
    cfg = local_broker_config(tmp_path, **{"kafka.bootstrap_servers": kafka_broker.bootstrap,
                                           "kafka.topics.interactions": f"ext.{tmp_path.name}.i",
                                           "kafka.topics.rewards": f"ext.{tmp_path.name}.r"})
    rc, out = _run(kafka_up, cfg)
    assert rc == 0, out
    assert out.startswith(f"kafka.bootstrap_servers is set: using the cluster at {kafka_broker.bootstrap}; "
                          "no local broker started")
    assert not (tmp_path / "kafka").exists()
    rc, out = _run(kafka_status, cfg)
    assert rc == 0 and "Kafka: running, external cluster" in out
    assert f"  ext.{tmp_path.name}.i  partitions=4" in out
    rc, out = _run(kafka_down, cfg)
    assert rc == 0 and "no local broker to stop" in out


@pytest.mark.kafka
def test_weights_topic_is_compacted_and_others_retained(kafka_config):
    """The weights topic also rolls a segment an hour: at Kafka's 7 days, a week of notices sat in the open
    segment, which compaction never touches, and every serving start replayed them."""
    from kafka.admin import ConfigResource

    backend = KafkaBackend(kafka_config)
    t = kafka_config.topics
    with backend.admin() as admin:
        described = admin.describe_configs([ConfigResource("topic", name) for name in
                                            (t.weights, t.interactions, t.rewards, t.dead_letters)])
    configs = {name: {key: entry["value"] for key, entry in topic.items()}
               for name, topic in described["topic"].items()}
    assert configs[t.weights]["cleanup.policy"] == "compact"
    assert configs[t.weights]["segment.ms"] == "3600000"  # compaction reaches all but the newest hour
    for name in (t.interactions, t.rewards, t.dead_letters):
        assert configs[name]["cleanup.policy"] == "delete"
        assert configs[name]["retention.ms"] == str(kafka_config.retention_ms)


@pytest.mark.kafka
def test_the_replication_an_existing_topic_holds_is_read_from_the_cluster(kafka_config):
    """What `kafka up` compares with kafka.replication_factor (streams.kafka_backend.replication_warnings)."""
    from kafka.admin import ConfigResource

    backend = KafkaBackend(kafka_config)
    t = kafka_config.topics
    with backend.admin() as admin:
        admin.alter_configs([ConfigResource("topic", t.rewards, {"min.insync.replicas": "3"})])
    held = backend.replication([t.interactions, t.rewards, "no-such-topic"])
    assert held == {t.interactions: (1, 1), t.rewards: (1, 3)}


@pytest.mark.kafka
def test_a_cluster_that_will_not_describe_topic_configs_still_gets_its_topics(kafka_broker):
    """The replication check is advisory: a Kafka-compatible service without DescribeConfigs stopped
    `kafka up` and the learner's start over it."""
    import kafka.errors as kerr

    class NoDescribeConfigs(KafkaBackend):
        def replication(self, names):
            raise kerr.UnsupportedVersionError("DescribeConfigs")

    warnings = NoDescribeConfigs(kafka_broker.kafka_config()).ensure_topics()
    assert warnings == ["the topics' replication was not checked (UnsupportedVersionError: "
                        "[Error 35] UnsupportedVersionError: DescribeConfigs)"]


@pytest.mark.kafka
def test_topics_the_cluster_cannot_hold_are_a_setting_to_change_not_an_outage(kafka_broker):
    """Three replicas on one broker: the error was a bare RuntimeError (a traceback from ``kafka up``)."""
    backend = KafkaBackend(kafka_broker.kafka_config(replication_factor=3))
    with pytest.raises(TopicsMisconfigured, match="InvalidReplicationFactor"):
        backend.ensure_topics()
    assert not issubclass(TopicsMisconfigured, StreamUnavailable)  # nothing waits for it to pass


def _network_threads() -> int:
    return sum(t.name.startswith("kafka-io") for t in threading.enumerate())


def test_an_unreachable_cluster_raises_stream_unavailable_and_leaves_no_client_running(tmp_path):
    """Every failed attempt is cleaned up: processes retry while the broker is down (serving's weights
    follower every few seconds), and kafka-python leaves a failed consumer's or admin client's network
    thread running (one per attempt, before streams/kafka_backend.py closed them)."""
    cfg = KafkaConfig(bootstrap_servers=f"127.0.0.1:{_free_port()}", client_timeout_s=0.5)
    before = _network_threads()
    backend = KafkaBackend(cfg)
    for _ in range(3):
        with pytest.raises(StreamUnavailable, match="not reachable"):
            backend.producer()
        with pytest.raises(StreamUnavailable):
            backend.consumer(["t"], group_id="g")
        with pytest.raises(StreamUnavailable):
            backend.consumer(["t"])
        with pytest.raises(StreamUnavailable):
            backend.list_topics()
    rc, out = _run(kafka_status, local_broker_config(tmp_path, **{"kafka.bootstrap_servers": cfg.bootstrap,
                                                                  "kafka.client_timeout_s": 0.5}))
    assert rc == 1 and f"Kafka cluster at {cfg.bootstrap} is not reachable" in out
    assert _network_threads() == before


def test_security_settings_reach_every_client():
    cfg = KafkaConfig(bootstrap_servers="a:1,b:2", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                      sasl_username="svc", sasl_password="s3cret", ssl_cafile="/etc/ca.pem", client_timeout_s=3)
    options = KafkaBackend(cfg).client_options()
    assert options == {"bootstrap_servers": ["a:1", "b:2"], "security_protocol": "SASL_SSL",
                       "bootstrap_timeout_ms": 3000, "sasl_mechanism": "SCRAM-SHA-512",
                       "sasl_plain_username": "svc", "sasl_plain_password": "s3cret", "ssl_cafile": "/etc/ca.pem"}


@pytest.mark.parametrize(("replicas", "in_sync"), [(1, "1"), (2, "2"), (3, "2")])
def test_topics_need_two_replicas_in_sync_whenever_there_are_replicas(replicas, in_sync):
    """Kafka's default min.insync.replicas is 1: acks=all then acknowledged a write only the leader held."""
    specs = KafkaBackend(KafkaConfig(replication_factor=replicas)).topic_specs()
    assert {spec["configs"]["min.insync.replicas"] for spec in specs.values()} == {in_sync}
    assert all(spec["replication_factor"] == replicas for spec in specs.values())
