import subprocess
import sys

import pytest

from apps.config import AppConfig
from online_sao.config import Config, ConfigError, Section, dump_config, flat_settings, load_config


def test_defaults_are_valid_and_local():
    cfg = load_config(environ={})
    assert cfg.kafka.is_local
    assert cfg.kafka.bootstrap == "127.0.0.1:19092"
    assert cfg.kafka.topics.interactions == "sao.interactions"
    assert cfg.mlflow_uri.startswith("sqlite:///")


def test_yaml_file_and_env_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("kafka:\n  bootstrap_servers: broker-a:9092\nalgorithm:\n  eps_low: 0.8\n")
    env = {"ONLINE_SAO__ALGORITHM__EPS_HIGH": "3.0", "UNRELATED": "x"}
    cfg = load_config(path, environ=env)
    assert cfg.kafka.bootstrap == "broker-a:9092" and not cfg.kafka.is_local
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.8, 3.0)


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("serving:\n  prot: 8000\n")
    with pytest.raises(ConfigError, match=r"serving\.prot: unknown key"):
        load_config(path, environ={})


def test_invalid_value_is_named():
    with pytest.raises(ConfigError, match=r"algorithm\.eps_low"):
        load_config(environ={"ONLINE_SAO__ALGORITHM__EPS_LOW": "1.5"})


@pytest.mark.parametrize(("name", "value", "named"), [
    ("TRAINER__MAX_VERSION_LAG", "-1", r"trainer\.max_version_lag"),  # would drop every rollout
    ("REWARD__DEFAULT_VALUE", "11", r"default_value \(11\) must lie within"),  # over max_value 10
    ("REWARD__DEFAULT_VALUE", ".nan", r"reward.default_value: .*finite"),
    ("ALGORITHM__POLICY_LR", ".inf", r"algorithm.policy_lr: .*finite"),  # every step was refused as non-finite
    ("REWARD__SOURCES", "[]", r"sources \[\] would apply no reward"),  # the learner would never step
    ("DEPLOY__WINDOW", "16", r"window \(16\) must hold gate_min_rollouts \(32\)"),  # the gate would refuse always
    ("DEPLOY__GATE_MIN_ESS", "200", r"window \(128\) must hold .* gate_min_ess \(200\)"),
])
def test_values_the_learner_cannot_use_are_refused(name, value, named):
    with pytest.raises(ConfigError, match=named):
        load_config(environ={f"ONLINE_SAO__{name}": value})


@pytest.mark.parametrize(("name", "value"), [
    ("KAFKA__SASL_PASSWORD", "p@ss #1"),  # YAML read " #1" as a comment: the password was cut short
    ("SERVING__FEEDBACK_SECRET", "#Xk9secret-value"),  # all comment: no secret at all, and no error
    ("SERVING__FEEDBACK_SECRET", "!Xk9secret-value"),  # a YAML tag: the error quoted the secret
    ("SERVING__DEPLOYMENT_ID", "2024-01-01"),  # a YAML date, refused as not a string
    ("KAFKA__SASL_PASSWORD", "123456"),  # a YAML number, refused as not a string
    ("PATHS__DATA_DIR", "/srv/data #2"),
])
def test_a_text_field_takes_its_environment_value_as_written(name, value):
    cfg = load_config(environ={f"ONLINE_SAO__{name}": value})
    section, key = name.lower().split("__")
    found = getattr(getattr(cfg, section), key)
    assert str(found.get_secret_value() if hasattr(found, "get_secret_value") else found) == value


def test_null_unsets_an_optional_text_field_as_the_deployments_do():
    """docker-compose.yml and the k8s job run `--set model.path=null base-model`."""
    assert load_config(environ={"ONLINE_SAO__MODEL__PATH": "null"}, overrides={}).model.path is None
    assert load_config(environ={"ONLINE_SAO__MODEL__PATH": "~"}).model.path is None
    assert str(load_config(environ={"ONLINE_SAO__MODEL__PATH": "/m/null"}).model.path) == "/m/null"


def test_an_environment_value_that_is_not_yaml_is_named_without_its_text():
    with pytest.raises(ConfigError, match=r"ONLINE_SAO__SERVING__API_KEYS: not a YAML value") as raised:
        load_config(environ={"ONLINE_SAO__SERVING__API_KEYS": "[!s3cret-key, other"})
    assert "s3cret" not in str(raised.value)
    keys = load_config(environ={"ONLINE_SAO__SERVING__API_KEYS": "[k1, k2]"}).serving.api_keys  # a list: YAML
    assert [k.get_secret_value() for k in keys] == ["k1", "k2"]


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_dump_round_trips_and_masks_secrets():
    cfg = load_config(environ={}, overrides={"serving.feedback_secret": "s3cret-value"})
    text = dump_config(cfg)
    assert "s3cret-value" not in text
    import yaml

    data = yaml.safe_load(text)
    data["serving"].pop("feedback_secret")
    assert Config.model_validate(data).serving.port == cfg.serving.port


def test_every_field_is_documented():
    seen = []

    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            seen.append(prefix + name)
            assert field.description, f"{prefix}{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, Section):
                walk(ann, f"{prefix}{name}.")

    walk(AppConfig)
    assert "kafka.topics.weights" in seen and "model.base.seed" in seen


def test_cli_config_show_and_bad_config_exit_code(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "apps.cli", "config", "show"],
                        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0, ok.stderr
    assert "interactions: sao.interactions" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  min_rollouts: -3\n")
    res = subprocess.run([sys.executable, "-m", "apps.cli", "--config", str(bad), "config", "show"],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "trainer.min_rollouts" in res.stderr and "Traceback" not in res.stderr


def test_dump_with_revealed_secrets_reloads_identically(tmp_path):
    cfg = load_config(environ={}, overrides={"serving.feedback_secret": "s3cret", "serving.api_keys": ["k1"]})
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg, reveal_secrets=True))
    again = load_config(path, environ={})
    assert again.serving.feedback_secret.get_secret_value() == "s3cret"
    assert [k.get_secret_value() for k in again.serving.api_keys] == ["k1"]
    assert again.model_dump(mode="json") == cfg.model_dump(mode="json")


def test_dump_with_revealed_secrets_reveals_the_keys_of_each_source(tmp_path):
    """serving.source_keys (a source -> its keys) stayed masked: a child process given the dump
    refused it, as its keys were not in serving.api_keys."""
    cfg = load_config(environ={}, overrides={"serving.api_keys": ["k1", "k2"], "serving.source_keys": {"judge": ["k2"]}})
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg, reveal_secrets=True))
    again = load_config(path, environ={})
    assert {source: [k.get_secret_value() for k in keys] for source, keys in again.serving.source_keys.items()} \
        == {"judge": ["k2"]}
    assert "k2" not in dump_config(cfg)  # masked unless revealed


@pytest.mark.parametrize("kv_layout", ["padded", "flat"])
def test_serving_compile_is_for_the_torch_engine_in_either_layout(kv_layout):
    compiled = {"serving.compile": True, "serving.kv_layout": kv_layout}
    assert load_config(environ={}, overrides=compiled).serving.compile
    with pytest.raises(ConfigError, match="torch engine"):
        load_config(environ={}, overrides={**compiled, "serving.engine": "vllm"})


def test_a_prompt_and_answer_longer_than_one_record_holds_are_refused_at_load():
    """Admitted and generated, such an answer failed the record's validation: 500, nothing logged."""
    fits = {"serving.max_prompt_tokens": 32_768 - 256, "serving.max_new_tokens": 256}  # 32768 in all
    assert load_config(environ={}, overrides=fits).serving.max_prompt_tokens == 32_512
    with pytest.raises(ConfigError, match="32513 \\+ 256.*32768 tokens one interaction record holds"):
        load_config(environ={}, overrides={**fits, "serving.max_prompt_tokens": 32_513})


def test_flat_settings_name_every_leaf_by_its_path():
    tree = {"a": {"b": 1, "c": {"d": [1, 2], "e": None}, "empty": {}}, "f": "x"}
    assert flat_settings(tree) == {"a.b": 1, "a.c.d": [1, 2], "a.c.e": None, "f": "x"}


def test_an_override_into_a_section_a_file_left_empty_applies(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("serving:\n  # port: 8001\n")  # every line under it commented out: null
    assert load_config(path, environ={}, overrides={"serving.port": 8002}).serving.port == 8002
    assert load_config(path, environ={"ONLINE_SAO__SERVING__PORT": "8003"}).serving.port == 8003


@pytest.mark.parametrize(("environ", "overrides", "named"), [
    ({"ONLINE_SAO__SERVING__PORT": "["}, {}, r"ONLINE_SAO__SERVING__PORT: not a YAML value"),
    ({}, {"serving.port.deeper": 1}, r"override serving\.port\.deeper: serving\.port is not a section"),
])
def test_a_value_that_cannot_be_placed_is_a_config_error_naming_it(tmp_path, environ, overrides, named):
    path = tmp_path / "run.yaml"
    path.write_text("serving:\n  port: 8001\n")
    with pytest.raises(ConfigError, match=named):
        load_config(path, environ=environ, overrides=overrides)


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"serving:\n  host: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path, environ={})


def test_a_key_given_twice_in_a_file_is_refused(tmp_path):
    """YAML keeps the last of two equal keys: a second `serving:` section replaced the first silently."""
    path = tmp_path / "run.yaml"
    path.write_text("serving:\n  port: 8001\ntrainer:\n  seed: 3\nserving:\n  host: 0.0.0.0\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: .*the key 'serving' is given twice.*line 5"):
        load_config(path, environ={})
    path.write_text("serving:\n  port: 8001\n  port: 8002\n")
    with pytest.raises(ConfigError, match="the key 'port' is given twice"):
        load_config(path, environ={})


def test_merge_keys_still_merge_and_a_list_as_a_key_is_still_a_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("x-serving: &base {port: 8001, host: 127.0.0.2}\nserving:\n  <<: *base\n  port: 8002\n")
    with pytest.raises(ConfigError, match="x-serving: unknown key"):  # the anchor's own section is no key
        load_config(path, environ={})
    path.write_text("trainer: &t {seed: 3}\nserving:\n  <<: {port: 8001, host: 127.0.0.2}\n  port: 8002\n")
    serving = load_config(path, environ={}).serving
    assert (serving.port, serving.host) == (8002, "127.0.0.2")  # the explicit key wins over the merged one
    path.write_text("serving:\n  ? [a]\n  : 1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path, environ={})


def test_a_yaml_error_names_the_file_and_the_line_and_quotes_none_of_it(tmp_path):
    """PyYAML's message quotes the offending line (here a secret with its closing quote missing) and
    names "<unicode string>" instead of the file."""
    path = tmp_path / "run.yaml"
    path.write_text('serving:\n  feedback_secret: "s3cr3t-value-XYZ\n  port: 8000\n')
    with pytest.raises(ConfigError) as refused:
        load_config(path, environ={})
    message = str(refused.value)
    assert message.startswith(f"{path}: not valid YAML: ") and "(line 2, column 20)" in message
    assert "s3cr3t" not in message and "<unicode string>" not in message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__  # no traceback quotes it either


def test_a_password_in_a_configured_url_is_masked_wherever_the_tree_is_dumped():
    """``config show``, the learner's MLflow params (the JSON dump, flattened) and config/resolved.yaml
    showed ``mlflow.tracking_uri`` with its password; a child process's resolved file still has it."""
    import yaml

    uri, store = "postgresql://mlflow:S3cretPw@db:5432/mlflow", "ftp://user:Ftp:Pw@host/weights"
    cfg = load_config(environ={"ONLINE_SAO__MLFLOW__TRACKING_URI": uri},
                      overrides={"trainer.weight_store": store})
    flat = flat_settings(cfg.model_dump(mode="json"))
    assert flat["mlflow.tracking_uri"] == "postgresql://mlflow:***@db:5432/mlflow"
    assert flat["trainer.weight_store"] == "ftp://user:***@host/weights"
    assert "S3cretPw" not in dump_config(cfg) and "Ftp:Pw" not in dump_config(cfg)
    revealed = yaml.safe_load(dump_config(cfg, reveal_secrets=True))
    assert (revealed["mlflow"]["tracking_uri"], revealed["trainer"]["weight_store"]) == (uri, store)
    assert (cfg.mlflow_uri, cfg.weight_store_url) == (uri, store)  # what the clients connect with


@pytest.mark.parametrize("uri", ["sqlite:////srv/a@b/mlflow.db", "http://mlflow:5000", "postgresql://user@db/x",
                                 "http://host:8080/path@x", None])
def test_a_url_without_a_password_is_shown_as_given(uri):
    from online_sao.config.base import mask_uri_password

    assert mask_uri_password(uri) == uri


def test_a_message_quoting_a_url_has_its_password_masked():
    """httpx's errors name the URL they asked, userinfo included."""
    from online_sao.config.base import mask_uri_password

    message = "Client error '404 Not Found' for url 'http://ops:Pw@mlflow:5000/health'; then s3://k:S@b/w"
    assert mask_uri_password(message) == ("Client error '404 Not Found' for url 'http://ops:***@mlflow:5000/health'; "
                                          "then s3://k:***@b/w")


@pytest.mark.parametrize("password", ["pa/ss", "p#ss", "p?ss", "p@ss", "a/b+c==", "pa'ss", 'pa"ss'])
def test_a_database_password_is_masked_whatever_characters_it_holds(password):
    """SQLAlchemy reads everything between the user's ':' and the '@' as the password, '/', '#' and '?'
    included (a base64 password holds '/'): the URL rule, which ends the authority at them, left it clear."""
    from online_sao.config.base import mask_uri_password

    message = f"MLflow at postgresql+psycopg2://user:{password}@db:5432/mlflow failed"
    assert mask_uri_password(message) == "MLflow at postgresql+psycopg2://user:***@db:5432/mlflow failed"


@pytest.mark.parametrize("uri, shown", [
    ("postgresql://db/mlflow?user=ml&password=Pg5ecret", "postgresql://db/mlflow?user=ml&password=***"),
    ("sqlite:///x.db?password=Sq5ecret", "sqlite:///x.db?password=***"),
    ("mysql+pymysql://db/mlflow?passwd=My5ecret&charset=utf8", "mysql+pymysql://db/mlflow?passwd=***&charset=utf8"),
    ("mssql+pyodbc://db/mlflow?UID=ml&PWD=Ms5ecret#x", "mssql+pyodbc://db/mlflow?UID=ml&PWD=***"),  # '#' is its
    ("postgresql://db/mlflow?sslpassword=Ke5ecret&sslmode=require",
     "postgresql://db/mlflow?sslpassword=***&sslmode=require"),
    ("mssql+pyodbc:///?odbc_connect=DRIVER%3DODBC%3BUID%3Dml%3BPWD%3DOd5ecret%3BDatabase%3Dx",
     "mssql+pyodbc:///?odbc_connect=DRIVER%3DODBC%3BUID%3Dml%3BPWD%3D***%3BDatabase%3Dx"),
    ("mssql+pyodbc:///?odbc_connect=UID%3Dml%3BPWD%3D%7BOd%3B5ecret%7D%7Dx%7D%3BEncrypt%3Dyes",  # ';' and '}' in it
     "mssql+pyodbc:///?odbc_connect=UID%3Dml%3BPWD%3D***%3BEncrypt%3Dyes"),
    ("postgresql://ml:Pg5ecret@db/mlflow?password=Pg5ecret", "postgresql://ml:***@db/mlflow?password=***"),
])
def test_a_password_given_as_a_query_parameter_is_masked(uri, shown):
    """Only ``user:pw@`` was masked: a password as a query parameter showed in ``config show``, the MLflow
    param mlflow.tracking_uri, resolved.yaml and logs."""
    from online_sao.config.base import mask_uri_password

    assert mask_uri_password(f"MLflow at {uri} failed") == f"MLflow at {shown} failed"
    cfg = load_config(environ={}, overrides={"mlflow.tracking_uri": uri})
    assert "5ecret" not in dump_config(cfg) and cfg.mlflow_uri == uri


@pytest.mark.parametrize("text", ["http://host/path?user=ml&passwords_seen=3", "http://host/?pwdx=1",
                                  "set password=on the server"])
def test_a_query_without_a_password_parameter_is_shown_as_given(text):
    from online_sao.config.base import mask_uri_password

    assert mask_uri_password(text) == text
