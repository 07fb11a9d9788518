"""Values a section refuses or normalises whatever source gives them: an empty YAML section, a YAML
boolean given to a number, ``~`` in a path read as is, Kafka SASL settings kafka-python cannot use."""

from pathlib import Path

import pytest

from online_sao.config import Config, ConfigError, KafkaConfig, dump_config, load_config

# --- a section with nothing under it -------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "serving:\n#  port: 8001\nkafka:\n  port: 19092\n",  # every line of the section commented out
    "serving:\n",
    "serving: null\nkafka:\n  topics:\n",  # a nested section too
    "kafka:\n  topics: ~\n",
])
def test_an_empty_yaml_section_is_an_empty_section_with_or_without_an_override(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    alone = load_config(path, environ={})
    assert alone == Config()
    touched = load_config(path, environ={"ONLINE_SAO__SERVING__PORT": "8000"})
    overridden = load_config(path, environ={}, overrides={"kafka.topics.rewards": "sao.rewards"})
    assert alone == touched == overridden


def test_a_section_given_a_value_is_still_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("serving: 5\n")
    with pytest.raises(ConfigError, match=r"serving: .*dictionary"):
        load_config(path, environ={})


# --- a YAML boolean is not a number --------------------------------------------------------------


@pytest.mark.parametrize(("text", "named"), [
    ("trainer:\n  metrics_port: off\n", r"trainer\.metrics_port: .*boolean"),  # 0: any free port, endpoint on
    ("trainer:\n  max_version_lag: no\n", r"trainer\.max_version_lag: .*boolean"),
    ("trainer:\n  max_steps: yes\n", r"trainer\.max_steps: .*boolean"),
    ("serving:\n  max_waiting: off\n", r"serving\.max_waiting: .*boolean"),  # 0: every request refused
    ("drift:\n  max_version_lag: off\n", r"drift\.max_version_lag: .*boolean"),
    ("drift:\n  policy_shrink: yes\n", r"drift\.policy_shrink: .*boolean"),  # a float field
    ("deploy:\n  monitor_min_scores: {quality: yes}\n", r"deploy\.monitor_min_scores: .*boolean.*quality"),
])
def test_a_yaml_boolean_given_to_a_number_is_refused_and_named(tmp_path, text, named):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        load_config(path, environ={})


@pytest.mark.parametrize(("key", "value"), [("serving.port", "true"), ("trainer.max_steps", "yes"),
                                            ("algorithm.eps_low", "on")])
def test_a_boolean_from_the_environment_or_an_override_is_refused_for_a_number(key, value):
    import yaml
    named = key.replace(".", r"\.") + r": .*boolean"
    with pytest.raises(ConfigError, match=named):
        load_config(environ={"ONLINE_SAO__" + key.upper().replace(".", "__"): value})
    with pytest.raises(ConfigError, match=named):
        load_config(environ={}, overrides={key: yaml.safe_load(value)})  # what `--set key=value` passes


@pytest.mark.parametrize(("text", "expected"), [("yes", True), ("no", False), ("true", True), ("false", False),
                                                ("on", True), ("off", False)])
def test_a_boolean_field_still_takes_yaml_booleans(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(f"drift:\n  enabled: {text}\nserving:\n  compile: {text}\n")
    cfg = load_config(path, environ={})
    assert cfg.drift.enabled is expected and cfg.serving.compile is expected
    assert load_config(environ={"ONLINE_SAO__DRIFT__ENABLED": text}).drift.enabled is expected


def test_numbers_and_text_paths_are_still_converted():
    cfg = load_config(environ={"ONLINE_SAO__SERVING__PORT": "8001", "ONLINE_SAO__TRAINER__MAX_WAIT_S": "1",
                               "ONLINE_SAO__PATHS__DATA_DIR": "/srv/data"})
    assert cfg.serving.port == 8001 and cfg.trainer.max_wait_s == 1.0 and cfg.paths.data_dir == Path("/srv/data")


# --- ~ in the paths read as they are -------------------------------------------------------------


@pytest.mark.parametrize(("name", "field"), [("TRAINER__PRETRAIN_FILE", ("trainer", "pretrain_file")),
                                             ("KAFKA__SSL_CAFILE", ("kafka", "ssl_cafile"))])
def test_a_home_relative_path_is_expanded(monkeypatch, tmp_path, name, field):
    monkeypatch.setenv("HOME", str(tmp_path))
    env = {f"ONLINE_SAO__{name}": "~/x"}
    if field[0] == "kafka":
        env["ONLINE_SAO__KAFKA__SECURITY_PROTOCOL"] = "SSL"
    cfg = load_config(environ=env)
    assert getattr(getattr(cfg, field[0]), field[1]) == tmp_path / "x"
    path = tmp_path / "run.yaml"
    path.write_text(f"{field[0]}:\n  {field[1]}: ~/x\n" + ("  security_protocol: SSL\n" if field[0] == "kafka" else ""))
    assert getattr(getattr(load_config(path, environ={}), field[0]), field[1]) == tmp_path / "x"


def test_the_expanded_ca_file_reaches_the_kafka_client(monkeypatch, tmp_path):
    from streams.kafka_backend import KafkaBackend
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(environ={"ONLINE_SAO__KAFKA__SSL_CAFILE": "~/ca.pem", "ONLINE_SAO__KAFKA__SECURITY_PROTOCOL": "SSL"})
    assert KafkaBackend(cfg.kafka).client_options()["ssl_cafile"] == str(tmp_path / "ca.pem")


def test_paths_expanded_where_they_are_used_are_dumped_as_given(monkeypatch, tmp_path):
    """data_dir, model.path, spool_dir, checkpoint_dir are expanded by Config's properties; what a
    finished run recorded (simulate --resume compares it) stays as it was written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(environ={"ONLINE_SAO__PATHS__DATA_DIR": "~/d", "ONLINE_SAO__MODEL__PATH": "~/m"})
    assert "data_dir: ~/d" in dump_config(cfg) and "path: ~/m" in dump_config(cfg)
    assert cfg.data_dir == (tmp_path / "d").resolve() and cfg.model_dir == (tmp_path / "m").resolve()


# --- Kafka SASL ----------------------------------------------------------------------------------

SASL = dict(bootstrap_servers="k:9092", security_protocol="SASL_SSL", sasl_username="u", sasl_password="p")


@pytest.mark.parametrize("mechanism", ["AWS_MSK_IAM", "GSSAPI", "OAUTHBEARER", "PLAIN", "SCRAM-SHA-256",
                                       "SCRAM-SHA-512"])
def test_kafka_pythons_sasl_mechanisms_are_taken(mechanism):
    assert KafkaConfig(**SASL, sasl_mechanism=mechanism).sasl_mechanism == mechanism


def test_the_mechanisms_are_those_kafka_python_knows():
    from typing import get_args

    from kafka.net.sasl import SASL_MECHANISMS
    literal, none = get_args(KafkaConfig.model_fields["sasl_mechanism"].annotation)  # Literal[...] | None
    allowed = set(get_args(literal))
    assert allowed == set(SASL_MECHANISMS)


@pytest.mark.parametrize("mechanism", ["scram-sha-512", "plain", "SCRAM_SHA_512", "KERBEROS"])
def test_a_mechanism_kafka_python_does_not_know_is_refused(mechanism):
    with pytest.raises(ConfigError, match=r"kafka\.sasl_mechanism"):
        load_config(environ={"ONLINE_SAO__KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                             "ONLINE_SAO__KAFKA__SASL_MECHANISM": mechanism})


@pytest.mark.parametrize("protocol", ["SASL_SSL", "SASL_PLAINTEXT"])
def test_a_sasl_protocol_needs_a_mechanism(protocol):
    with pytest.raises(ConfigError, match=r"kafka: .*sasl_mechanism"):
        load_config(environ={"ONLINE_SAO__KAFKA__SECURITY_PROTOCOL": protocol,
                             "ONLINE_SAO__KAFKA__BOOTSTRAP_SERVERS": "k:9092"})


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
@pytest.mark.parametrize("settings", [{"sasl_mechanism": "SCRAM-SHA-512"}, {"sasl_username": "online-sao"},
                                      {"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"}])
def test_sasl_settings_under_a_protocol_without_sasl_are_refused(protocol, settings):
    env = {"ONLINE_SAO__KAFKA__SECURITY_PROTOCOL": protocol,
           **{f"ONLINE_SAO__KAFKA__{k.upper()}": v for k, v in settings.items()}}
    with pytest.raises(ConfigError, match=rf"kafka: .*{protocol}"):
        load_config(environ=env)


# --- Kafka topic names ---------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "clash"), [
    ({"kafka.topics.rewards": "sao.interactions"}, "interactions and rewards are all 'sao.interactions'"),
    ({"kafka.topics.dead_letters": "sao.weights"}, "weights and dead_letters are all 'sao.weights'"),
    ({"kafka.topics.interactions": "t", "kafka.topics.rewards": "t", "kafka.topics.weights": "t"},
     "interactions, rewards and weights are all 't'"),
])
def test_two_topics_under_one_name_are_refused_and_the_clash_named(overrides, clash):
    """The backend made one topic for both (streams/kafka_backend.py topic_specs: the rewards topic as one
    compacted partition, say), and their readers took each other's records for their own."""
    with pytest.raises(ConfigError, match=rf"kafka\.topics: .*{clash}"):
        load_config(environ={}, overrides=overrides)


def test_topic_names_of_their_own_are_taken():
    names = {"kafka.topics.interactions": "i", "kafka.topics.rewards": "r", "kafka.topics.weights": "w",
             "kafka.topics.dead_letters": "d"}
    assert load_config(environ={}, overrides=names).kafka.topics.weights == "w"


# --- a shared-memory weight store's name ---------------------------------------------------------


@pytest.mark.parametrize("url", ["shm://online.sao", "cuda-ipc://a/b", "shm://", "cuda-ipc://" + "x" * 101,
                                 "shm://name\n"])
def test_a_weight_store_name_the_store_refuses_is_refused_at_load(url):
    """The store refused it only when ``learn`` opened it, with a traceback after building the models."""
    scheme = url.split("://")[0]
    with pytest.raises(ConfigError, match=rf"trainer\.weight_store: .*{scheme}://<name>: store name .*1-100 letters"):
        load_config(environ={}, overrides={"trainer.weight_store": url})


@pytest.mark.parametrize("url", ["shm://online-sao_1", "cuda-ipc://gpu0", "/srv/weights", "s3://bucket/a.b"])
def test_a_weight_store_the_stores_take_loads(url):
    assert load_config(environ={}, overrides={"trainer.weight_store": url}).weight_store_url == url
