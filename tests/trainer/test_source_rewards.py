"""Each reward source's recent mean (trainer/source_rewards.py) on hand-built rewards."""

from __future__ import annotations

import math

from trainer.source_rewards import MAX_SOURCES_SHOWN, SourceRewards


def test_each_source_keeps_its_newest_rewards():
    sources = SourceRewards(window=3)
    for judge, user in ((1.0, 0.0), (0.5, None), (0.0, 1.0), (1.0, None)):
        sources.observe({"judge": judge} if user is None else {"judge": judge, "user": user})
    # judge: 1.0 fell out of its window of 3 -> 0.5, 0.0, 1.0; user: 0.0, 1.0
    assert sources.stats() == {"judge": (0.5, 3), "user": (0.5, 2)}
    assert sources.metrics() == {"source.judge.reward": 0.5, "source.judge.count": 3.0,
                                 "source.user.reward": 0.5, "source.user.count": 2.0}


def test_sources_past_the_bound_are_folded_into_other():
    sources = SourceRewards(window=10)
    names = [f"s{i}" for i in range(MAX_SOURCES_SHOWN + 2)]
    for value, name in enumerate(names):
        sources.observe({name: float(value)})
    sources.observe({"other": 100.0})  # a source that calls itself other is not a label of its own either
    stats = sources.stats()
    assert set(stats) == set(names[:MAX_SOURCES_SHOWN]) | {"other"}
    assert stats["other"] == ((8.0 + 9.0 + 100.0) / 3, 3)
    sources.observe({"s0": 2.0})  # a source shown stays shown
    assert sources.stats()["s0"] == (1.0, 2)


def test_listed_sources_are_shown_from_the_start_and_only_they():
    sources = SourceRewards(window=4, sources=["judge", "user"])
    stats = sources.stats()
    assert set(stats) == {"judge", "user"} and math.isnan(stats["judge"][0]) and stats["user"][1] == 0
    sources.observe({"judge": 1.0, "scraper": 5.0})  # the join applies no unlisted source; one would be other
    assert sources.stats()["judge"] == (1.0, 1) and set(sources.stats()) == {"judge", "user", "other"}


def test_names_mlflow_refuses_are_written_with_underscores():
    sources = SourceRewards(window=2)
    sources.observe({"judge (v2)!": 0.5, "team/a b:c-d.e_f": 1.0})
    assert sources.metrics() == {"source.judge _v2__.reward": 0.5, "source.judge _v2__.count": 1.0,
                                 "source.team/a b:c-d.e_f.reward": 1.0, "source.team/a b:c-d.e_f.count": 1.0}
