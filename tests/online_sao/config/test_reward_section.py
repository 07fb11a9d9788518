"""The reward section's definition: what makes two runs' rewards one scale (the gate's records)."""

from __future__ import annotations

from online_sao.config import RewardConfig


def test_the_definition_changes_with_what_sets_a_reward_and_only_with_that():
    base = RewardConfig()
    same = [RewardConfig(window_s=60.0), RewardConfig(group_timeout_s=None), RewardConfig(memory_s=10_000.0),
            RewardConfig(train_aborted=True),
            RewardConfig(default_value=1.0)]  # unused while on_missing is "drop"
    assert {config.definition() for config in same} == {base.definition()}
    other = [RewardConfig(sources=["judge"]), RewardConfig(sources=["judge", "user"]),
             RewardConfig(sources=["user"], wait_for_sources=["user"]), RewardConfig(aggregation="mean"),
             RewardConfig(on_missing="default"), RewardConfig(on_missing="default", default_value=1.0),
             RewardConfig(min_value=0.0), RewardConfig(max_value=1.0), RewardConfig(revision="judge prompt v2")]
    digests = [config.definition() for config in other]
    assert len(set(digests)) == len(other) and base.definition() not in digests
    assert all(len(d) == 16 and set(d) <= set("0123456789abcdef") for d in digests)


def test_the_order_sources_are_listed_in_is_no_change():
    assert RewardConfig(sources=["judge", "user"], wait_for_sources=["judge", "user"]).definition() \
        == RewardConfig(sources=["user", "judge"], wait_for_sources=["user", "judge"]).definition()
