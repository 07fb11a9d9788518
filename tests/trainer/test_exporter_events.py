"""The learner's counters as Prometheus counters (``sao_learner_events_total``): from 0 in each
process, never down, so that a restart is a counter reset ``increase()`` handles. The lifetime totals
(``sao_learner_count``) go down at a restart: the alerts used to read them with ``increase()``, and a
restart alone fired DeadLettersRising with the whole total before it."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from trainer.exporter import LearnerExporter

EVENTS = "sao_learner_events"


def _counters(port: int) -> tuple[dict[str, str], dict[str, float], dict[str, float]]:
    """(each family's type, sao_learner_count by name, sao_learner_events_total by name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    types = {family.name: family.type for family in families}
    samples = [s for family in families for s in family.samples]
    totals = {s.labels["name"]: s.value for s in samples if s.name == "sao_learner_count"}
    events = {s.labels["name"]: s.value for s in samples if s.name == f"{EVENTS}_total"}
    return types, totals, events


def _run(port: int, restored: dict[str, float], later: list[dict[str, float]]) -> list[dict[str, float]]:
    """One learner process: its exporter given the restored totals, then ``later`` ones (steps and
    passes of the loop); the events scraped after each."""
    exporter = LearnerExporter("127.0.0.1", port)
    try:
        exporter.position(1, 2, restored)
        types, totals, events = _counters(port)
        assert types[EVENTS] == "counter"
        assert totals == restored  # the gauge stays: lifetime totals, as restored
        seen = [events]
        for i, counts in enumerate(later):
            if i % 2:
                exporter.position(1, 2, counts)
            else:
                exporter.step(2, 3, 0.5, {}, counts)
            seen.append(_counters(port)[2])
        return seen
    finally:
        exporter.close()


def _never_down(seen: list[dict[str, float]]) -> None:
    for before, after in zip(seen, seen[1:]):
        assert all(after[name] >= value for name, value in before.items()), (before, after)


def test_the_events_start_at_zero_in_each_process_and_never_go_down(free_port):
    checkpointed = {"dead_letters": 12.0, "join_rewards": 16.0}
    # the first process counts 5 dead letters and 6 rewards after its last checkpoint
    first = _run(free_port, checkpointed, [{"dead_letters": 15.0, "join_rewards": 20.0},
                                           {"dead_letters": 17.0, "join_rewards": 22.0}])
    assert first[0] == {"dead_letters": 0.0, "join_rewards": 0.0}
    assert first[-1] == {"dead_letters": 5.0, "join_rewards": 6.0}
    _never_down(first)
    # restarted from that checkpoint: the totals are back at 12 and 16 (the gauge went down), the
    # events start again from 0 (a reset) and count the records read again
    second = _run(free_port, checkpointed, [{"dead_letters": 17.0, "join_rewards": 22.0},
                                            {"dead_letters": 17.0, "join_rewards": 22.0}])
    assert second[0] == {"dead_letters": 0.0, "join_rewards": 0.0}
    assert second[-1] == {"dead_letters": 5.0, "join_rewards": 6.0}
    _never_down(second)


def test_a_total_that_falls_in_process_is_not_subtracted(free_port):
    seen = _run(free_port, {"rollbacks": 3.0}, [{"rollbacks": 4.0}, {"rollbacks": 2.0}, {"rollbacks": 5.0}])
    assert [events["rollbacks"] for events in seen] == [0.0, 1.0, 1.0, 4.0]
