"""The style corpus: deterministic, large enough, and styles that differ in form, not content."""

from __future__ import annotations

import random
import statistics
from collections import Counter, defaultdict

import pytest

from apps.default_model.corpus import (STYLES, StyleClassifier, compose_answer, generate_corpus, iter_prompts,
                               split_heldout, style_features)


@pytest.fixture(scope="module")
def corpus():
    return generate_corpus(seed=0)


def test_same_seed_same_corpus_other_seed_other_phrasing(corpus):
    assert generate_corpus(seed=0) == corpus
    other = generate_corpus(seed=1)
    assert [(e.prompt, e.style) for e in other] == [(e.prompt, e.style) for e in corpus]
    assert sum(a.answer != b.answer for a, b in zip(corpus, other)) > len(corpus) // 2


def test_hundreds_of_distinct_prompts_each_answered_in_every_style(corpus):
    prompts = [p for _, _, p in iter_prompts()]
    assert len(set(prompts)) == len(prompts) >= 300
    assert len({e.topic for e in corpus}) >= 10
    styles_of = defaultdict(Counter)
    for e in corpus:
        styles_of[e.prompt][e.style] += 1
    assert all(counts == Counter({s: 2 for s in STYLES}) for counts in styles_of.values())


def test_answers_are_short_and_terse_is_shortest(corpus):
    mean_words = {s: statistics.mean(len(e.answer.split()) for e in corpus if e.style == s) for s in STYLES}
    assert all(15 <= mean_words[s] <= 40 for s in ("formal", "cute", "archaic")), mean_words
    assert mean_words["terse"] < min(mean_words[s] for s in ("formal", "cute", "archaic")) - 5
    assert max(len(e.answer.split()) for e in corpus) <= 50


def test_every_style_carries_the_same_subject_advice():
    rng = random.Random(0)
    for topic, subject, _ in iter_prompts()[::7]:
        for style in STYLES:
            answer = compose_answer(style, subject, rng).lower()
            assert any(tip in answer for tip in subject.tips), (style, answer)


def test_heldout_split_keeps_whole_prompts_apart(corpus):
    train, heldout = split_heldout(corpus, fraction=0.2, seed=0)
    assert len(train) + len(heldout) == len(corpus)
    assert not {e.prompt for e in train} & {e.prompt for e in heldout}
    assert 0.1 < len(heldout) / len(corpus) < 0.3
    assert split_heldout(corpus, fraction=0.2, seed=0) == (train, heldout)
    assert split_heldout(corpus, fraction=0.2, seed=1)[1] != heldout
    with pytest.raises(ValueError):
        split_heldout(corpus, fraction=1.0)


def test_bag_of_words_separates_styles_on_unseen_prompts(corpus):
    train, heldout = split_heldout(corpus, fraction=0.2, seed=0)
    judge = StyleClassifier.fit(train)
    accuracy = sum(judge.predict(e.answer) == e.style for e in heldout) / len(heldout)
    assert accuracy >= 0.95


def test_no_single_token_identifies_a_style(corpus):
    # A marker token would detect its style with F1 near 1. Below 0.7, the best
    # "style s iff token t occurs" rule misses or mislabels a large share of
    # answers, so a judge has to weigh many words; the corpus measures 0.67 at most.
    answers_with = defaultdict(Counter)
    for e in corpus:
        for token in set(style_features(e.answer)):
            answers_with[token][e.style] += 1
    per_style = Counter(e.style for e in corpus)
    best = 0.0
    for token, by_style in answers_with.items():
        for style in STYLES:
            precision = by_style[style] / sum(by_style.values())
            recall = by_style[style] / per_style[style]
            if precision + recall:
                best = max(best, 2 * precision * recall / (precision + recall))
    assert best < 0.7


def test_judge_reads_hand_written_answers(corpus):
    judge = StyleClassifier.fit(corpus)
    assert judge.predict("Verily, thou shouldst water the plant, for 'tis the old way.") == "archaic"
    assert judge.predict("Ooh yay, just water the plant, hehe! Hugs <3") == "cute"
    assert judge.predict("I would recommend that you water the plant. Kind regards.") == "formal"
    assert judge.predict("Water the plant.") == "terse"


def test_unknown_style_is_rejected():
    with pytest.raises(ValueError, match="pirate"):
        generate_corpus(styles=("formal", "pirate"))
