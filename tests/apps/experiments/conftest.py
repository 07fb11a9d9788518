"""The style classifier, trained once per test session (a few seconds on the corpus)."""

from __future__ import annotations

import pytest

from apps.default_model.corpus import STYLES, generate_corpus, split_heldout
from apps.experiments.style import HELDOUT_FRACTION, StyleClassifier, train_classifier


@pytest.fixture(scope="session")
def style_classifier() -> StyleClassifier:
    return train_classifier(STYLES, seed=0)


@pytest.fixture(scope="session")
def heldout_answers():
    """Held-out corpus answers of the classifier's split (prompts it never trained on)."""
    return split_heldout(generate_corpus(0), HELDOUT_FRACTION, 0)[1]
