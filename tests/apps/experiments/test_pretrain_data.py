"""The value pre-training data: scored as the judge service scores, read back by the learner."""

from __future__ import annotations

import pytest

from apps.config import ArmConfig, ExperimentConfig, load_app_config
from apps.experiments.judge import QualityStyleJudge, Raters
from apps.experiments.pretrain_data import judge_rewards, write_records
from tests.apps.experiments.test_judge_service import ANSWERS, SCHEDULE, FixedJudge, chat_interaction
from trainer.history import rollouts_from_file


def test_records_are_scored_under_the_preference_and_read_back_by_the_learner(style_classifier, tmp_path):
    interactions = [chat_interaction(prompt, answer) for prompt, answer in ANSWERS[:4]]
    judge = QualityStyleJudge(style_classifier)
    rewards = judge_rewards(interactions, judge, "formal")

    assert [r.interaction_id for r in rewards] == [i.interaction_id for i in interactions]
    assert [r.value for r in rewards] == [judge.score(p, a, "formal").value for p, a in ANSWERS[:4]]
    archaic, formal = rewards[0].value, rewards[1].value  # same advice, two styles
    assert formal > 0.5 > archaic

    path = write_records(tmp_path / "arms" / "pretrain-data" / "records.jsonl", interactions, rewards)
    rollouts = rollouts_from_file(path, load_app_config(environ={}), version=3)  # the records' newest version
    assert {r.interaction_id: r.total_reward for r in rollouts} == {r.interaction_id: r.value for r in rewards}


def test_records_carry_the_raters_scale_as_the_judge_service_sends_it():
    rice, tennis = (chat_interaction(*ANSWERS[0]),
                    chat_interaction("How do I get better at tennis?", "Watch the ball onto the strings."))
    rewards = judge_rewards([rice, tennis], FixedJudge(), "formal", Raters({"cooking": 1.5}, {"sports": -0.5}))
    assert [r.value for r in rewards] == [0.75, 0.0]  # the fixed judge's 0.5: x 1.5 (cooking), - 0.5 (sports)


def test_no_arm_may_take_the_pre_training_pass_name():
    with pytest.raises(ValueError, match="reserved"):
        ExperimentConfig(schedule=SCHEDULE, rollouts_per_arm=6, arms=[ArmConfig(name="pretrain-data")])


def test_the_in_process_value_pre_training_leaves_out_rollouts_past_the_models_vocabulary(tmp_path, monkeypatch):
    """As the learner's (trainer/startup.py): a rollout with a token id past the vocabulary went to the
    critic's fit, whose embedding lookup crashed."""
    from types import SimpleNamespace

    from apps.experiments.inprocess import pretrain_critic
    from streams.records import encode
    from tests.trainer.records import make_interaction, make_reward

    vocab = 64
    records = [make_interaction("fits", created_at=1.0), make_reward("fits", 1.0),
               make_interaction("past", response=(8, 9, vocab + 100), created_at=2.0), make_reward("past", 1.0)]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\n".join(encode(r) for r in records) + b"\n")
    fitted: list[list[str]] = []
    monkeypatch.setattr("trainer.pretrain.pretrain_critic",
                        lambda critic, optimizer, rollouts, *args, **kwargs: fitted.append(
                            [r.interaction_id for r in rollouts]) or {})
    optimizers = SimpleNamespace(critic=None, critic_scheduler=None)
    models = SimpleNamespace(vocab_size=vocab, pad_token_id=0,
                             trainables=SimpleNamespace(critic=None, optimizers=optimizers))
    learner = SimpleNamespace(cfg=load_app_config(environ={}), version=0, models=models)
    pretrain_critic(learner, path)
    assert fitted == [["fits"]]
