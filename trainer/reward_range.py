"""The learner's range of rewards: what ``reward.min_value``..``max_value`` accept, on every path a reward
reaches training by (the feed, value pre-training's history), as serving's feedback endpoint does."""

from __future__ import annotations

from online_sao.config import RewardConfig
from online_sao.schemas import Reward


def reward_out_of_range(reward: Reward, cfg: RewardConfig) -> str | None:
    """Why ``reward`` (its value or a turn's) lies outside ``reward.min_value``..``max_value``, or None
    when it lies within. Serving's feedback endpoint refuses such a reward (422); one produced straight
    to the rewards topic (a judge on a 0-100 scale) trained, and wrecked the critic."""
    return outside_range([("value", reward.value)] +
                         [(f"turn_rewards turn {t.turn}", t.value) for t in reward.turn_rewards], cfg)


def outside_range(values: list[tuple[str, float]], cfg: RewardConfig) -> str | None:
    """Why the first of the named reward ``values`` outside ``reward.min_value``..``max_value`` is, or
    None when all lie within (a record's value and turns, or a join checkpoint's contribution's)."""
    for name, value in values:
        if not cfg.min_value <= value <= cfg.max_value:
            return (f"reward {name} {value:g} is outside the accepted range [{cfg.min_value:g}, {cfg.max_value:g}] "
                    f"(reward.min_value, reward.max_value)")
    return None
