"""Can the project's critic learn a scenario's reward, given enough rollouts? (issue 14)

Online, sao's critic predicts the drift scenario's reward only 5-15% better than a running mean
(docs/drift-restart/critic-vs-mean.md). This separates the two possible reasons: a critic that
cannot represent the reward (capacity) or one that is not given enough data and updates online.

The starting policy answers ``--rollouts`` pool prompts under the scenario's first preference,
in this process (what value pre-training collects, ``collect_pretrain_inprocess``). The last
``--test`` of them are a fixed test set. For each ``n:lr:attention`` spec a fresh critic
(``ValueModel.from_policy``; attention ``frozen`` or ``trained``) is fitted on the first ``n``
others with the value pre-training routine (``trainer/pretrain.py``: minibatches of 16,
held-out early stopping on its own split) and AdamW at ``lr``, then measured on the test set:
explained variance of the values against the answers' rewards (``gamma`` and ``lambda_critic``
are 1, so every action token's target is the reward) over all action tokens, at each answer's
first action token (the prompt alone: a running mean's information) and at its last.

``--online n:order:per_step`` instead runs the scenario's own SAO learner steps (critic order,
rate, K and warm-up as configured, no value pre-training) over the first ``n`` training rollouts
in arrival order, ``per_step`` a step, and measures the critic on the same test set as it goes:
the online schedule on data that do not move, against which a drift run's critic can be read.

    .venv/bin/python benchmarks/critic_fit.py configs/drift.yaml --rollouts 640 \
        --fit 16:1.5e-3:frozen --fit 64:1.5e-3:frozen --fit 256:1.5e-3:frozen --fit 512:1.5e-3:frozen
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from online_sao.batch import Rollout, RolloutBatch, collate  # noqa: E402
from online_sao.config import AlgorithmConfig  # noqa: E402
from online_sao.critic import ValueModel  # noqa: E402
from online_sao.critic_order import CRITIC_ORDERS  # noqa: E402
from online_sao.losses import explained_variance  # noqa: E402

PRETRAIN_MAX_EPOCHS = 40
"""Epochs at most: enough that early stopping, not the cap, ends every fit measured so far."""
PRETRAIN_PATIENCE = 4
"""Epochs without a held-out gain before stopping; the learner's default 2 stops some small fits
at a plateau after one epoch, and this measures what the critic can learn, not that default."""


@dataclass(frozen=True)
class FitSpec:
    """One fit: ``n`` training rollouts, AdamW at ``lr``, attention frozen or trained."""

    n: int
    lr: float
    frozen: bool

    @classmethod
    def parse(cls, text: str) -> FitSpec:
        n, lr, attention = text.split(":")
        if attention not in ("frozen", "trained"):
            raise argparse.ArgumentTypeError(f"attention must be 'frozen' or 'trained', got {attention!r}")
        return cls(int(n), float(lr), attention == "frozen")


@dataclass(frozen=True)
class OnlineSpec:
    """One online fit: the scenario's own SAO learner steps (``critic_order``, ``critic_lr``,
    K, warm-up as configured) over the first ``n`` rollouts in arrival order, ``per_step`` a step."""

    n: int
    order: str
    per_step: int

    @classmethod
    def parse(cls, text: str) -> OnlineSpec:
        n, order, per_step = text.split(":")
        if order not in CRITIC_ORDERS:
            raise argparse.ArgumentTypeError(f"order must be one of {CRITIC_ORDERS}, got {order!r}")
        return cls(int(n), order, int(per_step))


def action_positions(action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` indices of each row's first and last action token (rows need at least one)."""
    if not bool(action_mask.any(dim=1).all()):
        raise ValueError("every row needs an action token")
    positions = torch.arange(action_mask.shape[1]).expand_as(action_mask)
    first = torch.where(action_mask, positions, action_mask.shape[1]).min(dim=1).values
    last = torch.where(action_mask, positions, -1).max(dim=1).values
    return first, last


def explained_variance_on_test(values: torch.Tensor, batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
    """Explained variance of ``values [B, T]`` against each row's reward ``[B]``: over every
    action token, at the first action token of each row and at its last."""
    targets = rewards[:, None].expand_as(values)
    first, last = action_positions(batch.action_mask)
    rows = torch.arange(values.shape[0])
    every = torch.ones(values.shape[0], dtype=torch.bool)
    return {"all_tokens": explained_variance(values, targets, batch.action_mask),
            "first_token": explained_variance(values[rows, first], rewards, every),
            "last_token": explained_variance(values[rows, last], rewards, every)}


@torch.no_grad()
def _critic_on_test(critic: ValueModel, test_batch: RolloutBatch, test_rewards: torch.Tensor) -> dict[str, float]:
    """:func:`explained_variance_on_test` of ``critic``'s values on the test set."""
    return explained_variance_on_test(critic(test_batch.input_ids, test_batch.attention_mask), test_batch,
                                      test_rewards)


def _collect(scenario: str, data_dir: str, rollouts: int) -> tuple[object, Path]:
    """The scenario's config and the file of its starting policy's rollouts (the default model built)."""
    from apps.config import load_app_config
    from apps.experiments.inprocess import collect_pretrain_inprocess
    from apps.experiments.style import load_or_train

    cfg = load_app_config(scenario, overrides={
        "paths.data_dir": data_dir, "experiment.pretrain_rollouts": rollouts,
        "experiment.results_dir": str(Path(data_dir) / "critic-fit")})
    path = collect_pretrain_inprocess(cfg, load_or_train(cfg), progress=lambda line: print(line, file=sys.stderr))
    return cfg, path


def _answered(path: Path, cfg, vocab_size: int) -> list[Rollout]:
    """The rollouts of ``path`` with an answer, as the learner's value pre-training reads them (a token id
    past the model's vocabulary leaves its rollout out, trainer/startup.py)."""
    from trainer.history import rollouts_from_file

    return [r for r in rollouts_from_file(path, cfg, 0, vocab_size) if r.num_action_tokens > 0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario")
    parser.add_argument("--data-dir", default="data", help="paths.data_dir (the default model is built there)")
    parser.add_argument("--rollouts", type=int, default=640)
    parser.add_argument("--test", type=int, default=128, help="the last rollouts, held out as the test set")
    parser.add_argument("--fit", type=FitSpec.parse, action="append", default=[], help="n:lr:frozen|trained")
    parser.add_argument("--online", type=OnlineSpec.parse, action="append", default=[],
                        help="n:critic_order:rollouts_per_step (the learner's own SAO steps, in arrival order)")
    args = parser.parse_args(argv)

    from online_sao.modeling import load_policy, load_tokenizer
    from trainer.pretrain import pretrain_critic

    torch.set_num_threads(1)
    started = time.time()
    cfg, path = _collect(args.scenario, args.data_dir, args.rollouts)
    policy = load_policy(cfg.model_dir, cfg.model.dtype)
    rollouts = _answered(path, cfg, policy.get_input_embeddings().num_embeddings)
    if len(rollouts) <= args.test:
        raise SystemExit(f"{len(rollouts)} rollouts with an answer: fewer than --test {args.test} plus training data")
    test, pool = rollouts[-args.test:], rollouts[:-args.test]
    rewards = torch.tensor([r.total_reward for r in rollouts])
    print(f"{len(rollouts)} rollouts of the starting policy ({time.time() - started:.0f} s), reward mean "
          f"{rewards.mean():.3f}, variance {rewards.var():.4f}; test set: the last {len(test)}\n")
    pad = load_tokenizer(cfg.model_dir).pad_token_id
    test_batch = collate(test, pad)
    test_rewards = torch.tensor([r.total_reward for r in test])
    for spec in args.online:
        _print_online(spec, cfg, policy, pool, pad, test_batch, test_rewards)
    print("| training rollouts | lr | attention | epochs | EV on its split | test EV, all tokens "
          "| test EV, first token | test EV, last token | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.fit:
        if spec.n > len(pool):
            raise SystemExit(f"--fit {spec.n}: only {len(pool)} training rollouts")
        torch.manual_seed(0)
        critic = ValueModel.from_policy(policy, freeze_attention=spec.frozen)
        optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=spec.lr)
        t = time.time()
        fit = pretrain_critic(critic, optimizer, pool[:spec.n], cfg.algorithm, pad,
                              max_epochs=PRETRAIN_MAX_EPOCHS, patience=PRETRAIN_PATIENCE)
        ev = _critic_on_test(critic, test_batch, test_rewards)
        print(f"| {spec.n} | {spec.lr:g} | {'frozen' if spec.frozen else 'trained'} | {fit['epochs']:.0f} "
              f"| {fit['ev_after']:.3f} | {ev['all_tokens']:.3f} | {ev['first_token']:.3f} "
              f"| {ev['last_token']:.3f} | {time.time() - t:.0f} |", flush=True)


def fit_online(spec: OnlineSpec, algorithm_cfg: AlgorithmConfig, policy: torch.nn.Module, rollouts: list[Rollout],
               pad: int, checkpoints: list[int]) -> Iterator[tuple[int, ValueModel]]:
    """SAO learner steps of ``spec.per_step`` rollouts over ``rollouts`` in order, from a fresh
    copy of ``policy`` and a fresh critic (as a learner without value pre-training starts):
    after each of ``checkpoints`` rollouts, ``(count, critic)``, the critic as it then stands
    (the same object: evaluate it before going on)."""
    import copy

    from online_sao.algorithms import build_algorithm, build_critic, build_optimizers

    cfg = algorithm_cfg.model_copy(update={"name": "sao", "critic_order": spec.order})
    torch.manual_seed(0)
    student = copy.deepcopy(policy)
    critic = build_critic(cfg, student)
    opt = build_optimizers(cfg, student, critic)
    rule = build_algorithm(cfg, student, critic, opt.policy, opt.critic, opt.critic_scheduler)
    for start in range(0, spec.n, spec.per_step):
        done = min(start + spec.per_step, spec.n)
        rule.step(collate(rollouts[start:done], pad))
        if done in checkpoints:
            yield done, critic


def _print_online(spec: OnlineSpec, cfg, policy, pool: list[Rollout], pad: int, test_batch: RolloutBatch,
                  test_rewards: torch.Tensor) -> None:
    if spec.n > len(pool):
        raise SystemExit(f"--online {spec.n}: only {len(pool)} training rollouts")
    print(f"\nOnline: SAO learner steps of {spec.per_step} rollouts, critic_order {spec.order}, "
          f"critic_lr {cfg.algorithm.critic_lr:g}, K {cfg.algorithm.critic_updates}, no value pre-training\n")
    print("| rollouts seen | test EV, all tokens | test EV, first token | test EV, last token | seconds |")
    print("|---|---|---|---|---|")
    checkpoints = sorted({n for n in (16, 32, 64, 128, 256, 512, spec.n) if n <= spec.n and n % spec.per_step == 0})
    t = time.time()
    for done, critic in fit_online(spec, cfg.algorithm, policy, pool, pad, checkpoints):
        ev = _critic_on_test(critic, test_batch, test_rewards)
        print(f"| {done} | {ev['all_tokens']:.3f} | {ev['first_token']:.3f} | {ev['last_token']:.3f} "
              f"| {time.time() - t:.0f} |", flush=True)
    print()


if __name__ == "__main__":
    main()
