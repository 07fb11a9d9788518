"""A learner killed inside a roll-back's registry record: ``RunTracker.record_decision('rolled_back')``
writes the decision's tags (``decision=rolled_back``, ``rollback_carried_out=false``) and then moves the
``candidate`` alias back to the champion. Killed between the two, the restarted learner carries the
roll-back out (``rollback_due``); the rejected version must not stay ``candidate``, where the next
decision could promote it."""

from __future__ import annotations

import logging
import math

import torch

from online_sao.schemas import decode
from tests.fixtures.mlflow import tracker_config
from tests.trainer.test_deploy import STYLE_A, FixedKL, ScriptedScorer, _registry_parts, _rollout
from trainer.deploy import OffPolicyGate
from trainer.releases import Releases
from trainer.registry_versions import CANDIDATE, CHAMPION
from trainer.tracking import RunTracker


class Killed(BaseException):
    """The learner's process ends here (SIGKILL, an OOM kill, a lost node)."""


def test_a_roll_back_killed_before_its_alias_moved_never_promotes_the_rejected_version(tmp_path, caplog):
    cfg = tracker_config(tmp_path, **{"deploy.window": 120, "deploy.monitor_max_kl": 0.5})
    backend, publisher, tracker, window = _registry_parts(cfg)
    scorer = ScriptedScorer(dict.fromkeys(range(1, 12), STYLE_A))

    def releases_with(tracker, kl):
        return Releases(publisher, tracker, OffPolicyGate(scorer, cfg.deploy), window, cfg.deploy, 2,
                        reference=FixedKL(kl))

    def release(releases, v):
        outcome = releases.release({"w": torch.full((2,), float(v))}, v, v, {}, (0.0, 0.0))
        window.observe([_rollout(f"v{v}-{i}", [5, STYLE_A], v, 1.0, logprob=math.log(0.9) / 2) for i in range(40)])
        return outcome

    releases = releases_with(tracker, {2: 0.1, 4: 0.9})  # v4's KL trips the monitor
    for v in range(1, 6):
        release(releases, v)
    assert tracker.registry.champion()[0] == 2 and tracker.registry.candidate()[0] == 4

    real = tracker.client.set_registered_model_alias

    def killed_moving_the_candidate(name, alias, version):
        if alias == CANDIDATE:
            raise Killed()
        return real(name, alias, version)

    tracker.client.set_registered_model_alias = killed_moving_the_candidate
    try:
        release(releases, 6)  # decides on v4: rolled back, killed before the alias moved
        raise AssertionError("the roll-back was expected to be killed")
    except Killed:
        pass
    tracker.client.set_registered_model_alias = real
    client, name = tracker.client, cfg.mlflow.registered_model

    def registry_version(policy: int):
        return next(mv for mv in client.search_model_versions(f"name = '{name}'")
                    if mv.tags["policy_version"] == str(policy))

    v2, v4 = registry_version(2), registry_version(4)
    assert v4.tags["decision"] == "rolled_back" and v4.tags["rollback_carried_out"] == "false"
    assert client.get_registered_model(name).aliases[CANDIDATE] == v4.version  # the crash's state

    # the restart (same run); the KL the monitor reads on the new window is lower this time
    restarted = RunTracker(cfg, run_id=tracker.run_id)
    releases = releases_with(restarted, {2: 0.1, 4: 0.3, 8: 0.1})
    due = releases.rollback_due()
    assert due is not None and due.version == 2
    with caplog.at_level(logging.WARNING, logger="trainer.tracking"):
        assert restarted.registry.candidate()[0] == 2  # the roll-back's move finished
    assert any("rolled back" in r.message and "candidate" in r.message for r in caplog.records)
    assert client.get_registered_model(name).aliases == {CHAMPION: v2.version, CANDIDATE: v2.version}

    # the learner carries the roll-back out: the champion's weights again as v7
    publisher.publish({"w": torch.full((2,), 2.0)}, 7, 7)
    releases.rollback_carried_out(7)
    window.observe([_rollout(f"v7-{i}", [5, STYLE_A], 7, 1.0, logprob=math.log(0.9) / 2) for i in range(40)])
    outcome = release(releases, 8)  # the next registration point: nothing to decide, v8 registered
    assert outcome.registered and outcome.rolled_back_to is None

    v4, v8 = registry_version(4), registry_version(8)
    assert restarted.registry.champion()[0] == 2 and restarted.registry.candidate()[0] == 8
    assert client.get_registered_model(name).aliases == {CHAMPION: v2.version, CANDIDATE: v8.version}
    assert v4.tags["decision"] == "rolled_back" and v4.tags["rollback_carried_out"] == "v7"
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    # recorded before it is announced: killed inside the record, it never sent its notice; the champion's
    # weights went out as v7 instead
    assert [(n.action, n.version) for n in notices if n.action == "rollback"] == []
    assert [n.checksum for n in notices if (n.action, n.version) == ("publish", 7)] == [due.checksum]
    assert ("champion", 4) not in [(n.action, n.version) for n in notices]

    for v in (9, 10):  # and on: v8 is decided on its own evidence, v4 never comes back
        release(releases, v)
    assert restarted.registry.champion()[0] != 4
    assert registry_version(4).tags["decision"] == "rolled_back"
