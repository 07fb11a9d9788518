"""Settings the configured learner never reads (:func:`unread_settings`).

Each is valid, but set away from its default under a rule (``algorithm.name``) or a drift response
(``drift.enabled``) that never reads it, it changes nothing: ``critic_order`` on ppo, a critic's
learning rate on running_mean, any ``drift.*`` setting with the drift response off. MLflow records the
value as a parameter of the run all the same, so an ablation read from there looked as if it had run
with it. The learner names them in one warning at start rather than refusing them: one configuration
serves every arm of an experiment (a critic's learning rate set for sao is there for the running-mean
arm too).
"""

from __future__ import annotations

from online_sao.config.algorithm import AlgorithmConfig
from online_sao.config.deploy import DriftConfig

READ_BY = {
    **dict.fromkeys(("critic_updates", "critic_order", "lambda_alpha", "value_shrinkage_window",
                     "value_level_window", "critic_rewarm_rollouts", "critic_after_metrics", "critic_replay_rollouts"),
                    frozenset({"sao"})),
    # the critic itself, and its targets when value pre-training fits it (trainer/pretrain.py)
    **dict.fromkeys(("critic_lr", "critic_warmup_steps", "freeze_critic_attention", "critic_trainable_layers",
                     "lambda_critic"), frozenset({"sao", "ppo"})),
    "running_mean_window": frozenset({"running_mean"}),
    "group_size": frozenset({"grpo"}),
    **dict.fromkeys(("clip_low", "clip_high", "ppo_epochs"), frozenset({"grpo", "ppo"})),
    "ppo_lambda": frozenset({"ppo"}),
    "gamma": frozenset({"sao", "ppo"}),  # the critic's targets, and value pre-training's
}
"""``algorithm.<key>`` -> the rules (``algorithm.name``) that read it (online_sao/sao.py, online_sao/baselines.py,
online_sao/algorithms.py). Keys every rule reads are not listed."""
DRIFT_RESPONSE_ALGORITHM_SETTINGS = ("critic_rewarm_rollouts",)
"""``algorithm.<key>`` only the drift response reads (trainer/plasticity.py, built with ``drift.enabled``
alone), besides every other ``drift.*`` setting."""


def unread_settings(algorithm: AlgorithmConfig, drift: DriftConfig) -> list[str]:
    """``section.key`` of every setting away from its default that ``algorithm.name`` or a drift
    response that is off never reads."""
    unread = [f"algorithm.{key}" for key, rules in READ_BY.items()
              if algorithm.name not in rules and _changed(algorithm, key)]
    if not drift.enabled:
        unread += [f"drift.{key}" for key in type(drift).model_fields if key != "enabled" and _changed(drift, key)]
        unread += [f"algorithm.{key}" for key in DRIFT_RESPONSE_ALGORITHM_SETTINGS
                   if _changed(algorithm, key) and f"algorithm.{key}" not in unread]
    return unread


def _changed(section, key: str) -> bool:
    return getattr(section, key) != type(section).model_fields[key].default
