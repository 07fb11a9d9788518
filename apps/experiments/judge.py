"""The judge: reward = quality x style, as in the SAO paper's online experiment (SAO.md section 5).

``style`` is the probability the project's style classifier (experiments/style.py)
gives the preferred style. ``quality`` in [0, 1] is the product of

* topicality: the answer must carry the advice of the prompt's subject. The corpus
  (apps/default_model/corpus_content.py) gives every subject two tips and a reason. Their
  *content words* are those used by at most COMMON_WORD_SUBJECTS of the 84 subjects
  ("umbrella", "water" yes; "the", "your", "keep" no). The match of a subject is the
  best share of one of its tips' (or its reason's) content words found in the
  answer; topicality is min(1, match / MATCH_FULL), scaled by match / rival when
  another subject matches better (an answer about pancakes to a question about
  rice). A prompt outside the corpus is matched by subject name; with no subject
  found, the prompt's own words of at least MIN_PROMPT_WORD letters serve.
* form: non-empty; ends a sentence (or with one of the corpus's emoticons); at most
  MAX_WORDS words and at least MIN_WORDS; no degenerate repetition (share of
  distinct word trigrams at least REPEAT_FLOOR, scaled linearly above it).

A single style word cannot earn a reward on its own: it is off topic and too short,
and appended to an on-topic answer in another style it barely moves the classifier.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from apps.default_model.corpus import iter_prompts
from apps.default_model.corpus_content import TOPICS, Subject
from apps.experiments.style import StyleClassifier

COMMON_WORD_SUBJECTS = 10
"""A word in the advice of more subjects than this is a function word here ("the", "your", "keep")."""
MATCH_FULL = 0.75
"""Share of one tip's content words that counts as carrying it (room for paraphrase)."""
MIN_PROMPT_WORD = 4
"""Letters of a prompt word that stands in for topic words when the prompt's subject is unknown."""
MIN_WORDS, MAX_WORDS = 3, 60
"""Sane answer length in words: the corpus's answers have 3 to 45."""
LENGTH_PENALTY = 0.5
"""Quality factor of an answer outside the length band."""
UNFINISHED_PENALTY = 0.5
"""Quality factor of an answer that stops mid-sentence (cut at max_tokens)."""
REPEAT_FLOOR = 0.5
"""Distinct share of word trigrams at or below which an answer is degenerate (quality 0)."""
SENTENCE_ENDS = (".", "!", "?", "~", ":)", ":3", "<3", "^_^")
"""Endings of a finished answer: punctuation, and the emoticons the cute voice closes with."""

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class JudgeScore:
    """``value`` = ``quality`` x ``style``, each in [0, 1]."""

    value: float
    quality: float
    style: float
    sampled_style: str | None = None
    """The style the classifier finds most likely in the answer (the style-share plots count these)."""


class Judge(Protocol):
    def score(self, prompt: str, answer: str, preferred_style: str) -> JudgeScore: ...


class TopicIndex:
    """Content words of every corpus subject's advice and the subject of every corpus prompt."""

    def __init__(self) -> None:
        subjects = [s for topic in TOPICS for s in topic.subjects]
        spread = Counter(w for s in subjects for w in set(words(" ".join((*s.tips, s.reason)))))
        self.advice = {s.name: tuple(frozenset(w for w in words(text) if spread[w] <= COMMON_WORD_SUBJECTS)
                                     for text in (*s.tips, s.reason)) for s in subjects}
        self._by_prompt = {prompt.strip().lower(): subject for _, subject, prompt in iter_prompts()}
        self._by_name = sorted(subjects, key=lambda s: -len(s.name))
        self._topic = {s.name: topic.name for topic in TOPICS for s in topic.subjects}

    def topic_of(self, prompt: str) -> str | None:
        """The corpus topic ``prompt`` asks about (via its subject); None when no subject is found."""
        subject = self.subject_of(prompt)
        return self._topic[subject.name] if subject is not None else None

    def subject_of(self, prompt: str) -> Subject | None:
        key = prompt.strip().lower()
        if key in self._by_prompt:
            return self._by_prompt[key]
        return next((s for s in self._by_name if re.search(rf"\b{re.escape(s.name)}\b", key)), None)

    def match(self, subject: str, used: set[str]) -> float:
        """Best share of one advice text's content words of ``subject`` found in ``used``."""
        return max(len(used & text) / len(text) for text in self.advice[subject] if text)

    def topicality(self, prompt: str, answer: str) -> float:
        """In [0, 1]; see the module docstring."""
        used = set(words(answer))
        subject = self.subject_of(prompt)
        if subject is None:
            wanted = {w for w in words(prompt) if len(w) >= MIN_PROMPT_WORD}
            return min(1.0, len(used & wanted) / len(wanted) / MATCH_FULL) if wanted else 0.0
        own = self.match(subject.name, used)
        rival = max(self.match(name, used) for name in self.advice if name != subject.name)
        score = min(1.0, own / MATCH_FULL)
        return score * own / rival if rival > own else score


def form_quality(answer: str) -> float:
    """In [0, 1]: finished, sanely long, not repetitive (see the module docstring)."""
    text = answer.strip()
    tokens = words(text)
    if not tokens:
        return 0.0
    quality = 1.0
    if not text.endswith(SENTENCE_ENDS):
        quality *= UNFINISHED_PENALTY
    if not MIN_WORDS <= len(tokens) <= MAX_WORDS:
        quality *= LENGTH_PENALTY
    trigrams = list(zip(tokens, tokens[1:], tokens[2:]))
    if trigrams:
        distinct = len(set(trigrams)) / len(trigrams)
        quality *= min(1.0, max(0.0, (distinct - REPEAT_FLOOR) / (1.0 - REPEAT_FLOOR)))
    return quality


class QualityStyleJudge:
    """reward = quality x P(preferred style | answer)."""

    def __init__(self, classifier: StyleClassifier, topics: TopicIndex | None = None) -> None:
        self.classifier = classifier
        self.topics = topics or TopicIndex()

    def score(self, prompt: str, answer: str, preferred_style: str) -> JudgeScore:
        if preferred_style not in self.classifier.styles:
            raise ValueError(f"style {preferred_style!r} is not one the classifier knows: {self.classifier.styles}")
        quality = self.topics.topicality(prompt, answer) * form_quality(answer)
        probs = self.classifier.probs([answer])[0]
        style = float(probs[self.classifier.styles.index(preferred_style)])
        sampled = self.classifier.styles[int(probs.argmax())]
        return JudgeScore(value=quality * style, quality=quality, style=style, sampled_style=sampled)


@dataclass(frozen=True)
class Rating:
    """What a prompt's raters give for a judged answer: ``reward`` = value x ``scale`` + ``offset``."""

    reward: float
    scale: float = 1.0
    offset: float = 0.0


class Raters:
    """Raters who rate on scales of their own, by the prompt's topic (``experiment.rater_scale``
    and ``rater_offset``): a topic not named, or a prompt of no known topic, gets scale 1 and
    shift 0, the judge's value itself."""

    def __init__(self, scale: dict[str, float] | None = None, offset: dict[str, float] | None = None,
                 topics: TopicIndex | None = None) -> None:
        self.scale = dict(scale or {})
        self.offset = dict(offset or {})
        # The index reads the whole corpus: built only where some topic's raters differ.
        self.topics = topics or (TopicIndex() if self.scale or self.offset else None)

    def rate(self, prompt: str, value: float) -> Rating:
        if self.topics is None:  # no topic's raters differ
            return Rating(value)
        topic = self.topics.topic_of(prompt)
        scale, offset = self.scale.get(topic, 1.0), self.offset.get(topic, 0.0)
        return Rating(value * scale + offset, scale, offset)
