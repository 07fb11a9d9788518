"""The judge's style classifier: accurate on unseen prompts, not fooled by one marker word."""

from __future__ import annotations

import torch

from apps.config import load_app_config
from apps.default_model.corpus import STYLES, generate_corpus, split_heldout
from apps.experiments import style as style_module
from apps.experiments.style import (HELDOUT_FRACTION, StyleClassifier, classifier_dir, fingerprint, fit,
                                          load_or_train, text_features)

HIGH_CONFIDENCE = 0.8
"""A probability the judge would pay out most of a reward for."""


def test_features_are_words_bigrams_and_length():
    feats = text_features("Hark, friend!")
    assert feats == ["hark", ",", "friend", "!", "hark ,", ", friend", "friend !", "<len0>"]


def test_heldout_accuracy_and_probabilities(style_classifier, heldout_answers):
    stats = style_classifier.stats
    assert stats.heldout_examples == len(heldout_answers) > 100
    assert stats.heldout_accuracy >= 0.95
    probs = style_classifier.probs([e.answer for e in heldout_answers])
    assert probs.shape == (len(heldout_answers), len(STYLES))
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(len(heldout_answers)))
    true = probs[torch.arange(len(heldout_answers)), [STYLES.index(e.style) for e in heldout_answers]]
    assert true.mean() > 0.95


def test_vocabulary_holds_no_single_topic_word(style_classifier):
    # "metronome" belongs to one subject's advice; style words are used on every topic.
    vocab = set(style_classifier.vocab)
    assert {"metronome", "umbrella", "dough"}.isdisjoint(vocab)
    assert {"thou", "hehe", "furthermore", "<len0>"} <= vocab


def strongest_words(classifier: StyleClassifier, style: str, count: int) -> list[str]:
    """The single words that push hardest towards ``style`` (largest weight above the mean)."""
    margin = classifier.weight[classifier.styles.index(style)] - classifier.weight.mean(dim=0)
    words = [(margin[i].item(), f) for i, f in enumerate(classifier.vocab) if " " not in f and not f.startswith("<")]
    return [f for _, f in sorted(words, reverse=True)[:count]]


def test_one_marker_word_does_not_buy_a_style(style_classifier, heldout_answers):
    for style in STYLES:
        markers = strongest_words(style_classifier, style, 5)
        column = style_classifier.styles.index(style)
        for marker in markers:
            texts = [f"{e.answer} {marker}" for e in heldout_answers if e.style != style]
            p = style_classifier.probs(texts)[:, column]
            assert p.max() < HIGH_CONFIDENCE, (style, marker, texts[int(p.argmax())], p.max())
            assert p.mean() < 0.1, (style, marker, p.mean())


def test_training_is_seeded():
    train = split_heldout(generate_corpus(0), HELDOUT_FRACTION, 0)[0][::20]
    a, b = fit(train, STYLES, seed=3, steps=10), fit(train, STYLES, seed=3, steps=10)
    assert a.vocab == b.vocab
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)


def test_cache_is_reused_and_rebuilt_on_a_new_fingerprint(tmp_path, style_classifier, monkeypatch):
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})
    style_classifier.save(classifier_dir(cfg), fingerprint(STYLES, cfg.model.base.seed))
    trained = []

    def small_training(styles, seed):  # the real one, on a tenth of the corpus
        trained.append(styles)
        model = fit(generate_corpus(seed, styles=styles)[::10], styles, seed, steps=10)
        model.stats = style_classifier.stats
        return model

    monkeypatch.setattr(style_module, "train_classifier", small_training)
    lines: list[str] = []
    loaded = load_or_train(cfg, lines.append)
    assert trained == [] and "loaded" in lines[0]
    texts = ["Hark! Thou shouldst rest.", "Rest. Done."]
    torch.testing.assert_close(loaded.probs(texts), style_classifier.probs(texts))
    assert loaded.stats == style_classifier.stats

    fewer = cfg.model_copy(update={"experiment": cfg.experiment.model_copy(update={
        "styles": ["formal", "terse", "cute"],
        "schedule": [{"from_rollout": 0, "style": "formal"}, {"from_rollout": 5, "style": "terse"},
                     {"from_rollout": 9, "style": "cute"}]})})
    rebuilt = load_or_train(fewer, lines.append)
    assert trained == [("formal", "terse", "cute")]
    assert rebuilt.styles == ("formal", "terse", "cute") and rebuilt.probs(texts).shape == (2, 3)


def test_probabilities_do_not_depend_on_where_the_weights_sat_in_memory(style_classifier, heldout_answers):
    """safetensors hands out tensors at any byte offset of its buffer, and a matrix product rounds
    differently on memory aligned differently: built from such a tensor, the classifier gave the
    same text rewards a few ulps apart from its pickled copy in a worker process, and a seeded run
    did not repeat there. The classifier keeps its own copies."""
    weight, bias = style_classifier.weight, style_classifier.bias
    buffer = torch.zeros(weight.numel() + 1)
    shifted = buffer[1:].view_as(weight)  # 4 bytes off the buffer's alignment
    shifted.copy_(weight)
    assert shifted.data_ptr() % 64 != weight.data_ptr() % 64
    texts = [e.answer for e in heldout_answers]
    aligned = StyleClassifier(style_classifier.styles, style_classifier.vocab, weight, bias)
    offset = StyleClassifier(style_classifier.styles, style_classifier.vocab, shifted, bias)
    assert torch.equal(torch.cat([aligned.probs([t]) for t in texts]), torch.cat([offset.probs([t]) for t in texts]))
