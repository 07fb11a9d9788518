"""The stack of processes an experiment or the smoke run starts: a SIGTERM to the parent stops them."""

import os
import signal
import subprocess
import sys

import pytest
import yaml

from apps.config import load_app_config
from apps.stack import Component, Stack
from online_sao.config import dump_config


def test_sigterm_inside_the_stack_stops_its_processes_and_restores_the_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(SystemExit) as exited:
        with Stack(None, {}, tmp_path) as stack:
            stack.components.append(Component("sleeper", child, tmp_path / "sleeper.log"))
            os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == 128 + signal.SIGTERM
    assert child.poll() is not None  # terminated by stop_all, not left running
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("already_running", [True, False])
def test_a_run_stops_the_broker_it_started_and_leaves_one_it_found_running(tmp_path, monkeypatch, already_running):
    """`smoke`, `simulate`, `load` and `agent` next to a broker the operator started with `kafka up`."""
    stopped = []

    class Broker:
        log_file = tmp_path / "kafka.log"

        def __init__(self, cfg, stop_with_parent):
            pass

        def start(self):
            return not already_running

        def stop(self):
            stopped.append(True)

    class Backend:
        def __init__(self, cfg):
            pass

        def ensure_topics(self):
            pass

    monkeypatch.setattr("streams.broker.LocalBroker", Broker)
    monkeypatch.setattr("streams.kafka_backend.KafkaBackend", Backend)
    with Stack(None, {"paths.data_dir": str(tmp_path)}, tmp_path, progress=lambda line: None) as stack:
        stack.start_broker()
    assert stopped == ([] if already_running else [True])


@pytest.mark.parametrize("resolved", [True, False])
def test_children_of_a_resolved_config_do_not_read_the_environment_again(tmp_path, monkeypatch, resolved):
    """The agent and simulate hand their children a resolved dump with a free port of their own;
    ONLINE_SAO__SERVING__PORT left in the environment (the README's own example) moved the children's
    server to 8001 while the parent waited on the free port. A stack on the operator's own file
    (smoke, load) still takes the environment, as the parent did."""
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(load_app_config(environ={}, overrides={"serving.port": 45678}), reveal_secrets=True))
    monkeypatch.setenv("ONLINE_SAO__SERVING__PORT", "8001")
    with Stack(path, {}, tmp_path / "run", progress=lambda _: None, resolved=resolved) as stack:
        child = stack.start("show", ["config", "show"])
        assert child.process.wait(60) == 0
        shown = yaml.safe_load(child.log_path.read_text())
        expected = 45678 if resolved else 8001
        assert shown["serving"]["port"] == expected and stack.cfg.serving.port == expected


def test_overrides_reach_the_children_as_the_parent_read_them(tmp_path):
    """A string went to the child as YAML ('2024-01-01' with its quotes), and the child now takes a
    text field's --set value as written: the quotes became part of the deployment id."""
    overrides = {"serving.deployment_id": "2024-01-01", "kafka.sasl_password": "p@ss #1", "serving.port": 8123,
                 "serving.api_keys": ["k1", "k 2"]}
    stack = Stack(None, overrides, tmp_path / "run", progress=lambda _: None)
    child = stack.start("show", ["config", "show"])
    assert child.process.wait(60) == 0
    shown = yaml.safe_load(child.log_path.read_text())
    assert shown["serving"]["deployment_id"] == "2024-01-01" and shown["serving"]["port"] == 8123
    assert stack.cfg.kafka.sasl_password.get_secret_value() == "p@ss #1"
    assert len(shown["serving"]["api_keys"]) == 2
