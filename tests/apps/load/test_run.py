"""``online-sao load`` on its own stack when something breaks after the load began: a process of the
stack that exits, a broker gone for the read back. The stack's processes are stood in for (a fake
Stack whose serving "dies" when the fake endpoint stops answering); the clients, the CLI path, the
report and the files written are the real ones."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from apps import cli
from apps.config import load_app_config
from apps.load.gen import LoadGenerator
from apps.stack import StackError
from streams.base import StreamUnavailable

DURATION_S = 6.0
"""The load's duration: long enough that a run stopped early is told from one that went its course."""


class DyingServing:
    """An endpoint that answers ``answers`` chat requests, then is gone (connection refused), as a
    serving process that exited; ``exited`` says so to the fake stack."""

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.exited = False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.exited:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "online-sao", "policy_version": 0}]})
        await asyncio.sleep(0.01)
        self.answers -= 1
        self.exited = self.answers <= 0
        iid = f"sao-{self.answers}"
        return httpx.Response(200, json={
            "id": iid, "object": "chat.completion", "created": 0, "model": "online-sao",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "interaction_id": iid, "policy_version": 0, "policy_versions": [0]})


def _own_stack(monkeypatch, serving: DyingServing, check_logged) -> list[tuple[str, object]]:
    """Stand in for the stack's processes, the model build, the wait for the learner and Kafka.
    Returns what happened to the stack and the run's state, in order: ("stopped", None) when its
    processes were stopped, ("removed", run_dir) when the run's own state was removed."""
    events: list[tuple[str, object]] = []

    class FakeStack:
        def __init__(self, config_path, overrides, run_dir, progress=print):
            from apps.config import load_app_config

            self.cfg = load_app_config(config_path, environ={}, overrides=overrides)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start_broker(self):
            pass

        def start(self, name, command, env=None):
            return name

        def wait_http(self, *args):
            pass

        def check_alive(self):
            if serving.exited:
                raise StackError("serving exited with -9; see serving.log")

        def stop_components(self):
            events.append(("stopped", None))

    def run_load(base_url, api_key, params, progress=print, **halt):
        return asyncio.run(LoadGenerator(base_url, api_key, params, progress, prompts=["p"],
                                         transport=httpx.MockTransport(serving), **halt).run())

    monkeypatch.setattr("apps.stack.Stack", FakeStack)
    monkeypatch.setattr("apps.default_model.builder.build_base_model", lambda *args, **kwargs: "model")
    monkeypatch.setattr("apps.experiments.orchestrate.wait_for_consumers", lambda *args, **kwargs: None)
    monkeypatch.setattr("streams.kafka_backend.KafkaBackend", lambda *args, **kwargs: None)
    monkeypatch.setattr("apps.load.gen.run_load", run_load)
    monkeypatch.setattr("apps.load.run.check_logged", check_logged)
    from apps.run_state import RunState  # its check: the state named is the run's own, not the deployment's

    monkeypatch.setattr("apps.run_state.remove_run_state_of", lambda cfg, run_dir, progress=print: events.append(
        ("removed", RunState.of(cfg, run_dir).paths[0].parent)))
    return events


def _load(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "load.json"
    rc = cli.main(["--set", f"paths.data_dir={tmp_path}", "load", "--clients", "2", "--duration-s", str(DURATION_S),
                   "--stream-share", "0", "--feedback-share", "0", "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_a_process_that_exits_during_the_load_stops_it_and_the_results_are_still_written(tmp_path, monkeypatch,
                                                                                          capsys):
    """The stack was looked at only after the whole load (a dead serving hammered to the end), and its
    StackError unwound past the results: no JSON, no plot."""
    serving = DyingServing(answers=5)
    events = _own_stack(monkeypatch, serving, lambda *args, **kwargs: None)

    rc, saved = _load(tmp_path)

    assert rc == 1 and saved["passed"] is False
    assert events == []  # a failed run keeps its state for whoever looks into why
    assert "serving exited with -9" in saved["stack_error"] and "serving exited" in saved["stopped_early"]
    assert saved["summary"]["answered"] >= 5  # a request in flight when it "exited" may still be answered
    assert saved["summary"]["wall_s"] < DURATION_S / 2  # stopped early, not at the end of the duration
    assert (tmp_path / "load.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "stack: serving exited with -9" in out and "FAILED" in out


def test_a_broker_gone_for_the_read_back_fails_the_run_and_the_results_are_still_written(tmp_path, monkeypatch):
    """`load --url` kept its results then (commit 1fb8da5); the run on its own stack raised
    StreamUnavailable after the whole load instead."""
    def unreachable(*args, **kwargs):
        raise StreamUnavailable("Kafka at 127.0.0.1:1 not reachable")

    _own_stack(monkeypatch, DyingServing(answers=10**9), unreachable)

    rc, saved = _load(tmp_path, "--requests-per-client", "5")

    assert rc == 1 and saved["passed"] is False and saved["stack_error"] is None
    assert saved["summary"]["answered"] > 0
    assert "Kafka at 127.0.0.1:1 not reachable" in saved["kafka_check"]


@pytest.mark.parametrize("keep", [False, True])
def test_a_run_that_passed_removes_the_state_it_made_after_stopping_its_processes(tmp_path, monkeypatch, keep):
    """A smoke or load run in a cron left four topics, a consumer group, a registered model and its
    model directories behind, every time."""
    events = _own_stack(monkeypatch, DyingServing(answers=10**9), lambda *args, **kwargs: None)

    rc, saved = _load(tmp_path, "--requests-per-client", "2", *(["--keep-state"] if keep else []))

    assert rc == 0 and saved["passed"] is True
    run_dir = tmp_path / "runs" / saved["run_dir"].rsplit("/", 1)[-1]
    assert events == ([] if keep else [("stopped", None), ("removed", run_dir)])


@pytest.mark.parametrize("text", ["inf", "1e400"])
def test_positive_refuses_infinity(text):
    import argparse

    from apps.load.run import positive

    with pytest.raises(argparse.ArgumentTypeError, match="must be finite"):
        positive(float)(text)


def test_load_on_its_own_stack_leaves_the_deployments_registry_and_state_alone(tmp_path, monkeypatch):
    """The load's learner registered versions into the deployment's mlflow.registered_model and could
    move its aliases (champion, candidate), which production's canary and the learner's roll-back read;
    a --set naming the deployment's topics put the run back on them."""
    _own_stack(monkeypatch, DyingServing(answers=10**9), lambda *args, **kwargs: None)
    import apps.stack

    made = []

    class Recording(apps.stack.Stack):  # the fake stack of _own_stack
        def __init__(self, config_path, overrides, run_dir, progress=print):
            super().__init__(config_path, overrides, run_dir, progress)
            made.append((self.cfg, run_dir))

    monkeypatch.setattr("apps.stack.Stack", Recording)
    deployment = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})

    cli.main(["--set", f"paths.data_dir={tmp_path}", "--set", "mlflow.registered_model=prod-policy",
              "--set", "kafka.topics.weights=prod.weights", "load", "--clients", "1", "--requests-per-client", "1",
              "--stream-share", "0", "--feedback-share", "0", "--out", str(tmp_path / "load.json")])

    run, run_dir = made[0]
    assert run_dir.parent == tmp_path / "runs" and run_dir.name.startswith("load-")
    assert run.mlflow.registered_model == f"prod-policy.{run_dir.name}"
    assert run.mlflow.experiment == f"{deployment.mlflow.experiment}.{run_dir.name}"
    assert run.mlflow_uri == deployment.mlflow_uri  # the configured tracking server, still exercised
    assert run.kafka.topics.weights == f"prod.weights.{run_dir.name}"
    assert run.checkpoint_dir == run_dir / "checkpoints"
    assert run.serving.torch_threads == 1  # the load's own serving settings still apply
