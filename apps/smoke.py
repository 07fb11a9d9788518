"""``online-sao smoke``: the whole loop on the real stack, as quickly as possible.

Broker up, default model built, serving and learner started as their own
processes; simulated users chat through the official ``openai`` client and send
feedback; the learner trains with SAO and publishes; serving hot-swaps. Prints
progress and a summary; everything it ran is in MLflow and under
``<data_dir>/runs/smoke-<time>``.

The run has state of its own (:func:`apps.stack.own_state_overrides`): topics, consumer
group, weights, checkpoints, spool, MLflow experiment and registered model. A run that passed
removes it but for its logs and MLflow experiment (:mod:`apps.run_state`; ``--keep-state`` keeps it). It starts
from the base model and leaves the deployment's learner, topics and registry alone: it
resumed the deployment's checkpoint, trained it on made-up rewards and published onto
the weights topic every replica follows. An operator's hold on the deployment's weights
is on the deployment's topic, which the run's serving does not follow.

It passes only when serving answers with weights trained on this run's feedback
(:func:`smoke_verdict`), read from the run's own topic and ledger: a version above the
one serving started with, published at or after the first learner step whose ledger
lists one of this run's interactions.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from apps.config import AppConfig, client_api_key
from apps.stack import Stack, free_port, new_run, own_state_overrides
from online_sao.config.base import mask_uri_password
from online_sao.schemas import RecordError, WeightsNotice, decode
from streams.base import Consumer
from trainer.checkpoint import read_ledger

SMOKE_REQUESTS = 24
"""Chat requests the smoke run sends: enough for several learner steps on 2 CPU cores."""
VERSION_WAIT_S = 240.0
"""How long the smoke run waits for serving to answer with weights trained on its feedback."""
POLL_S = 2.0
"""Pause between two looks at serving's version, the weights notices and the ledger."""
SMOKE_MAX_TOKENS = 48
"""max_tokens of the smoke run's requests (a complete answer of about 20 words, which the stand-in
feedback prefers), lowered to ``serving.max_new_tokens`` where that is less: serving refuses more."""


@dataclass(frozen=True)
class SmokeEvidence:
    start_version: int
    """Serving's policy version before this run's first request."""
    served_version: int
    """Serving's policy version now."""
    version_steps: dict[int, int]
    """Learner step at which each version was published (the weights notices)."""
    trained: list[tuple[int, str]]
    """(step, interaction id) of every interaction the learner trained on (its ledger)."""
    run_ids: frozenset[str]
    """Interaction ids of this run's requests."""


def smoke_verdict(evidence: SmokeEvidence) -> str | None:
    """None when serving answers with weights trained on this run's feedback, else why not:
    the served version must be above the starting one and published at or after the first
    step that trained on one of this run's interactions."""
    e = evidence
    if e.served_version <= e.start_version:
        return (f"serving answers with policy version {e.served_version}, "
                f"the version it started with was {e.start_version}")
    first_step = min((step for step, iid in e.trained if iid in e.run_ids), default=None)
    if first_step is None:
        return f"the learner has trained on none of this run's {len(e.run_ids)} interactions"
    published_at = e.version_steps.get(e.served_version)
    if published_at is None:
        return f"no weights notice says at which step version {e.served_version} was published"
    if published_at < first_step:
        return (f"version {e.served_version} was published at step {published_at}, before step {first_step}, "
                f"the first to train on this run's feedback")
    return None


def _reward(answer: str, rng: random.Random) -> float:
    """Stand-in user feedback for the smoke loop: prefers concise, complete answers."""
    words = len(answer.split())
    complete = answer.rstrip().endswith((".", "!", "?"))
    return round((1.0 if complete else 0.0) - abs(words - 20) / 40 + rng.uniform(-0.05, 0.05), 3)


def run_smoke(cfg: AppConfig, config_path: Path | None = None, overrides: dict | None = None,
              requests: int = SMOKE_REQUESTS, keep_state: bool = False) -> int:
    """``keep_state``: leave the run's own state (:mod:`apps.run_state`) after a run that passed too."""
    from openai import OpenAI

    from apps.default_model.builder import build_base_model
    from apps.run_state import remove_run_state_of

    started = time.monotonic()
    port = free_port()
    run_id, run_dir = new_run(cfg.data_dir / "runs", "smoke")
    # its own state over the operator's --set too (which may name the deployment's topics); a
    # checkpoint every step keeps the ledger (what was trained, by step) current for the verdict
    overrides = {**(overrides or {}), **own_state_overrides(cfg, run_id, run_dir),
                 "serving.port": port, "trainer.min_rollouts": 4, "trainer.checkpoint_every": 1}
    with Stack(config_path, overrides, run_dir) as stack:
        cfg = stack.cfg  # the run's: every read below goes to its own topics, ledger and registry
        stack.start_broker()
        print(f"model: {build_base_model(cfg)}", flush=True)
        server = stack.start("serving", ["serve"])
        base_url = f"http://127.0.0.1:{port}"
        stack.wait_http(server, f"{base_url}/readyz", timeout_s=180)
        api_key = client_api_key(cfg) or "local"  # serving asks for a key whenever keys are configured
        auth = {"Authorization": f"Bearer {api_key}"}
        start_version = _served_version(base_url, cfg.serving.model_name, auth)
        print(f"serving starts at policy version {start_version}", flush=True)
        stack.start("learner", ["learn"])

        client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key)
        rng = random.Random(cfg.trainer.seed)
        prompts = _prompts(cfg.model.base.seed)
        run_ids: set[str] = set()
        for i in range(requests):
            stack.check_alive()
            reply = client.chat.completions.create(
                model=cfg.serving.model_name, max_tokens=smoke_max_tokens(cfg), temperature=1.0,
                messages=[{"role": "user", "content": prompts[i % len(prompts)]}])
            extra = reply.model_extra or {}
            answer = reply.choices[0].message.content or ""
            reward = _reward(answer, rng)
            run_ids.add(extra["interaction_id"])
            httpx.post(f"{base_url}/v1/feedback", json={"interaction_id": extra["interaction_id"],
                                                       "reward": reward, "source": "smoke"}, headers=auth,
                       timeout=30).raise_for_status()
            print(f"[{i + 1:>3}/{requests}] v{extra.get('policy_version')} reward {reward:+.2f}  {answer[:70]!r}",
                  flush=True)

        evidence, failure = _wait_for_training_on_this_run(stack, base_url, auth, start_version, frozenset(run_ids))
        if failure is None and not keep_state:  # before the broker this run started stops
            stack.stop_components()
            remove_run_state_of(cfg, run_dir)
    if failure is not None:
        print(f"smoke run FAILED after {time.monotonic() - started:.0f} s: {failure}; logs in {run_dir / 'logs'}")
        return 1
    print(f"smoke run finished in {time.monotonic() - started:.0f} s: serving answers with policy version "
          f"{evidence.served_version} (started at {start_version}), published at step "
          f"{evidence.version_steps[evidence.served_version]} after training on this run's feedback; "
          f"logs in {run_dir / 'logs'}; MLflow at {mask_uri_password(cfg.mlflow_uri)}, experiment "
          f"{cfg.mlflow.experiment}")
    return 0


def smoke_max_tokens(cfg: AppConfig) -> int:
    """max_tokens of the smoke run's requests: :data:`SMOKE_MAX_TOKENS`, at most what serving grants."""
    return min(SMOKE_MAX_TOKENS, cfg.serving.max_new_tokens)


def _served_version(base_url: str, model_name: str, headers: dict[str, str]) -> int:
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10)
    response.raise_for_status()
    models = response.json()["data"]
    return next(m["policy_version"] for m in models if m["id"] == model_name)


def _wait_for_training_on_this_run(stack: Stack, base_url: str, headers: dict[str, str], start_version: int,
                                   run_ids: frozenset[str]) -> tuple[SmokeEvidence, str | None]:
    """Gather the evidence until :func:`smoke_verdict` accepts it or VERSION_WAIT_S passed."""
    from streams.kafka_backend import KafkaBackend

    cfg = stack.cfg
    notices = KafkaBackend(cfg.kafka).consumer([cfg.kafka.topics.weights], group_id=None, start="earliest")
    version_steps: dict[int, int] = {}
    deadline = time.monotonic() + VERSION_WAIT_S
    try:
        while True:
            stack.check_alive()
            version_steps.update(_published_steps(notices, cfg.serving.model_name))
            evidence = SmokeEvidence(start_version, _served_version(base_url, cfg.serving.model_name, headers),
                                     version_steps,
                                     read_ledger(cfg.checkpoint_dir, refused=False), run_ids)
            failure = smoke_verdict(evidence)
            if failure is None or time.monotonic() > deadline:
                return evidence, failure
            time.sleep(POLL_S)
    finally:
        notices.close()


def _published_steps(consumer: Consumer, model_name: str) -> dict[int, int]:
    """version -> step of the publish notices for ``model_name`` read now (unreadable ones are
    skipped: serving dead-letters them)."""
    steps = {}
    for message in consumer.poll(timeout_s=0.5):
        try:
            notice = decode(message.value, WeightsNotice)
        except RecordError:
            continue
        if notice.action == "publish" and notice.model == model_name:
            steps[notice.version] = notice.step
    return steps


def _prompts(seed: int) -> list[str]:
    from apps.default_model.corpus import generate_corpus

    seen: dict[str, None] = {}
    for example in generate_corpus(seed):
        seen.setdefault(example.prompt, None)
    prompts = list(seen)
    random.Random(seed).shuffle(prompts)
    return prompts[:64]
