"""The default judge: reward = quality x style, on literal answers and on the corpus."""

from __future__ import annotations

import itertools
import statistics

import pytest

from apps.default_model.corpus import STYLES
from apps.experiments.judge import QualityStyleJudge, Raters, Rating, TopicIndex, form_quality

RICE = "How do I make rice?"
ARCHAIC_RICE = "Hark! Thou shouldst rinse the grains until the water runs clear. Fare thee well."
TERSE_RICE = "Rinse the grains until the water runs clear."


@pytest.fixture(scope="module")
def judge(style_classifier):
    return QualityStyleJudge(style_classifier)


def test_on_style_on_topic_answer_scores_high_and_only_for_its_style(judge):
    good = judge.score(RICE, ARCHAIC_RICE, "archaic")
    assert good.quality == 1.0 and good.value > 0.9
    assert good.value == pytest.approx(good.quality * good.style)
    assert judge.score(RICE, ARCHAIC_RICE, "formal").value < 0.05
    assert judge.score(RICE, TERSE_RICE, "terse").value > 0.9
    formal = "I would recommend that you rinse the grains until the water runs clear. Kind regards."
    assert judge.score(RICE, formal, "formal").value > 0.9


def test_off_topic_answer_scores_low(judge):
    pancakes = "Hark! Thou shouldst leave a few lumps in the batter. Fare thee well."
    score = judge.score(RICE, pancakes, "archaic")
    assert score.style > 0.9 and score.quality < 0.1 and score.value < 0.1


def test_repeated_junk_scores_low(judge):
    for junk in ("rinse rinse rinse rinse rinse rinse rinse rinse.", "Hark! Hark! Hark! Hark! Hark! Hark! Hark!",
                 "Rinse the grains. Rinse the grains. Rinse the grains. Rinse the grains. Rinse the grains."):
        assert judge.score(RICE, junk, "archaic").value < 0.1, junk


def test_a_single_marker_word_scores_low(judge):
    for marker in ("Verily.", "Thou", "Hehe~", "Furthermore."):
        assert judge.score(RICE, marker, "archaic").value < 0.1, marker
    # Appended to an on-topic answer in another style, a marker word earns little of the reward.
    tagged = judge.score(RICE, TERSE_RICE + " Verily.", "archaic")
    assert tagged.quality == 1.0 and tagged.value < 0.2


def test_an_unfinished_answer_loses_half(judge):
    whole = judge.score(RICE, "Thou shouldst rinse the grains until the water runs clear.", "archaic")
    cut = judge.score(RICE, "Thou shouldst rinse the grains until the water runs clear and", "archaic")
    assert whole.quality == 1.0 and cut.quality == 0.5
    # Cut earlier, the answer also carries less of the tip.
    assert judge.score(RICE, "Thou shouldst rinse the grains until the", "archaic").quality == pytest.approx(
        0.5 * (3 / 6) / 0.75)


def test_form_quality_literals():
    assert form_quality("") == 0.0
    assert form_quality("   ") == 0.0
    assert form_quality(TERSE_RICE) == 1.0
    assert form_quality("Hugs and sparkles ^_^") == 1.0
    assert form_quality(TERSE_RICE[:-1]) == 0.5
    assert form_quality("Rest.") == 0.5  # one word: below MIN_WORDS
    distinct_words = ["".join(letters) for letters in itertools.product("abc", repeat=4)]
    assert form_quality(" ".join(distinct_words[:60]) + ".") == 1.0
    assert form_quality(" ".join(distinct_words[:61]) + ".") == 0.5  # above MAX_WORDS
    assert form_quality("a b a b a b a b.") == 0.0  # 2 distinct of 6 trigrams
    # 9 distinct of 10 trigrams: (0.9 - 0.5) / 0.5
    assert form_quality("one two three one two three four five six seven eight nine.") == pytest.approx(0.8)


def test_topic_index_finds_the_subject():
    topics = TopicIndex()
    assert topics.subject_of(RICE).name == "rice"
    assert topics.subject_of("  how do i make RICE?  ").name == "rice"
    assert topics.subject_of("My rice keeps burning, help").name == "rice"
    assert topics.subject_of("What is the meaning of life?") is None
    # An unknown subject: the prompt's own long words stand in for topic words.
    assert topics.topicality("Explain photosynthesis briefly", "Photosynthesis turns light into sugar.") \
        == pytest.approx(1 / 3 / 0.75)  # 1 of explain, photosynthesis, briefly
    assert topics.topicality("Explain photosynthesis briefly", "Bake bread.") == 0.0


def test_the_raters_follow_the_prompts_topic():
    topics = TopicIndex()
    assert topics.topic_of(RICE) == "cooking"
    assert topics.topic_of("How do I get better at tennis?") == "sports"
    assert topics.topic_of("What is the meaning of life?") is None
    raters = Raters({"cooking": 1.5, "sports": 0.5}, {"cooking": -0.25, "tech": 0.5}, topics)
    assert raters.rate(RICE, 0.5) == Rating(0.5, 1.5, -0.25)  # 0.5 x 1.5 - 0.25
    assert raters.rate("How do I get better at tennis?", 0.5) == Rating(0.25, 0.5, 0.0)
    assert raters.rate("How do I fix a slow laptop?", 0.5) == Rating(1.0, 1.0, 0.5)  # tech: shifted only
    assert raters.rate("How do I keep my plants alive?", 0.5) == Rating(0.5)  # gardening: not named
    assert raters.rate("What is the meaning of life?", 0.5) == Rating(0.5)  # no topic found
    assert Raters(topics=topics).rate(RICE, 0.5) == Rating(0.5)


def test_unknown_style_is_an_error(judge):
    with pytest.raises(ValueError, match="gothic"):
        judge.score(RICE, ARCHAIC_RICE, "gothic")


def test_corpus_answers_score_high_in_their_own_style(judge, heldout_answers):
    by_style = {s: [judge.score(e.prompt, e.answer, s).value for e in heldout_answers if e.style == s]
                for s in STYLES}
    cross = [judge.score(e.prompt, e.answer, s).value for e in heldout_answers for s in STYLES if s != e.style]
    for style, values in by_style.items():
        assert statistics.mean(values) > 0.95 and min(values) > 0.5, style
    assert statistics.mean(cross) < 0.02
