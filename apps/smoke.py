"""``online-sao smoke``: the whole loop on the real stack, as quickly as possible.

Broker up, default model built, serving and learner started as their own
processes; simulated users chat through the official ``openai`` client and send
feedback; the learner trains with SAO and publishes; serving hot-swaps and its
``policy_version`` rises. Prints progress and a summary; everything it ran is
in MLflow and under ``<data_dir>/runs/smoke``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx

from apps.config import AppConfig
from apps.stack import Stack, free_port

SMOKE_REQUESTS = 24
"""Chat requests the smoke run sends: enough for several learner steps on 2 CPU cores."""
VERSION_WAIT_S = 240.0
"""How long the smoke run waits for serving to answer with weights the learner published."""


def _reward(answer: str, rng: random.Random) -> float:
    """Stand-in user feedback for the smoke loop: prefers concise, complete answers."""
    words = len(answer.split())
    complete = answer.rstrip().endswith((".", "!", "?"))
    return round((1.0 if complete else 0.0) - abs(words - 20) / 40 + rng.uniform(-0.05, 0.05), 3)


def run_smoke(cfg: AppConfig, config_path: Path | None = None, overrides: dict | None = None,
             requests: int = SMOKE_REQUESTS) -> int:
    from openai import OpenAI

    from apps.default_model.builder import build_base_model

    started = time.monotonic()
    port = free_port()
    overrides = {**(overrides or {}), "serving.port": port, "trainer.min_rollouts": 4}
    run_dir = cfg.data_dir / "runs" / "smoke"
    with Stack(config_path, overrides, run_dir) as stack:
        stack.start_broker()
        print(f"model: {build_base_model(cfg)}", flush=True)
        server = stack.start("serving", ["serve"])
        base_url = f"http://127.0.0.1:{port}"
        stack.wait_http(server, f"{base_url}/readyz", timeout_s=180)
        stack.start("learner", ["learn"])

        client = OpenAI(base_url=f"{base_url}/v1", api_key="local")
        rng = random.Random(cfg.trainer.seed)
        prompts = _prompts(cfg.model.base.seed)
        for i in range(requests):
            stack.check_alive()
            reply = client.chat.completions.create(
                model=cfg.serving.model_name, max_tokens=48, temperature=1.0,
                messages=[{"role": "user", "content": prompts[i % len(prompts)]}])
            extra = reply.model_extra or {}
            answer = reply.choices[0].message.content or ""
            reward = _reward(answer, rng)
            httpx.post(f"{base_url}/v1/feedback", json={"interaction_id": extra["interaction_id"],
                                                       "reward": reward, "source": "smoke"}, timeout=30).raise_for_status()
            print(f"[{i + 1:>3}/{requests}] v{extra.get('policy_version')} reward {reward:+.2f}  {answer[:70]!r}",
                  flush=True)

        version = _wait_for_new_version(stack, base_url, cfg.serving.model_name)
    print(f"smoke run finished in {time.monotonic() - started:.0f} s: serving answers with policy version {version}; "
          f"logs in {run_dir / 'logs'}; MLflow at {cfg.mlflow_uri}")
    return 0 if version > 0 else 1


def _wait_for_new_version(stack: Stack, base_url: str, model_name: str) -> int:
    deadline = time.monotonic() + VERSION_WAIT_S
    version = 0
    while time.monotonic() < deadline:
        stack.check_alive()
        models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
        version = next(m["policy_version"] for m in models if m["id"] == model_name)
        if version > 0:
            return version
        time.sleep(2.0)
    print(f"serving still answers with version {version} after {VERSION_WAIT_S:.0f} s")
    return version


def _prompts(seed: int) -> list[str]:
    from apps.default_model.corpus import generate_corpus

    seen: dict[str, None] = {}
    for example in generate_corpus(seed):
        seen.setdefault(example.prompt, None)
    prompts = list(seen)
    random.Random(seed).shuffle(prompts)
    return prompts[:64]
