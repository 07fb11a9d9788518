"""A style classifier trained on the project's corpus: the style half of the judge's reward.

Logistic regression (one linear layer, softmax over styles) on a bag of corpus
words, word bigrams and a length bucket. Each answer's feature counts are scaled
to unit L2 norm, so one added word moves an answer of n words by about 1/sqrt(n)
of its length in feature space: a style is carried by many phrasings, never by a
single marker token (tests/apps/experiments/test_style.py appends each
style's strongest word to off-style answers and checks the prediction holds).
The vocabulary holds features seen at least FEATURE_MIN_COUNT times in training;
unseen features are ignored. Training is seeded, full batch, a few seconds on CPU.

Cached under ``data_dir/models/style_classifier``: ``weights.safetensors``
(weight [S, V], bias [S]) and ``classifier.json`` (styles, vocabulary, the
fingerprint it was built from and its held-out accuracy).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from apps.config import AppConfig
from apps.default_model.corpus import CORPUS_VERSION, Example, generate_corpus, split_heldout, style_features
from apps.experiments.scenario import BASE_MODEL_HELDOUT_FRACTION

CLASSIFIER_FORMAT = 1
"""Bumped when features or training change, so cached classifiers are rebuilt."""
HELDOUT_FRACTION = BASE_MODEL_HELDOUT_FRACTION
"""Prompts kept out of training: the base model's held-out split (same share, same seed), so
held-out accuracy is measured on prompts neither model trained on."""
FEATURE_MIN_COUNT = 2
"""A feature enters the vocabulary only when training answers use it this often (drops one-offs)."""
FEATURE_MIN_TOPICS = 3
"""... and only when answers on this many topics use it: words of one topic's advice
("metronome", "dough") say what an answer is about, not how it is written."""
TRAIN_STEPS = 200
LEARNING_RATE = 0.1
WEIGHT_DECAY = 1e-3
"""Full-batch AdamW on the linear layer; the decay keeps weights of rare features small."""
WEIGHTS_FILE, META_FILE = "weights.safetensors", "classifier.json"

Progress = Callable[[str], None]


def text_features(text: str) -> list[str]:
    """Corpus words and punctuation, adjacent-word bigrams, and one length bucket."""
    *tokens, length = style_features(text)
    return tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])] + [length]


@dataclass(frozen=True)
class ClassifierStats:
    train_examples: int
    heldout_examples: int
    heldout_accuracy: float
    vocab_size: int
    seconds: float


class StyleClassifier:
    """``probs(texts) -> [N, S]`` over ``styles``; see the module docstring."""

    def __init__(self, styles: tuple[str, ...], vocab: list[str], weight: torch.Tensor,
                 bias: torch.Tensor, stats: ClassifierStats | None = None) -> None:
        if weight.shape != (len(styles), len(vocab)) or bias.shape != (len(styles),):
            raise ValueError(f"weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match "
                             f"{len(styles)} styles and {len(vocab)} features")
        self.styles = styles
        self.vocab = vocab
        self.index = {feature: i for i, feature in enumerate(vocab)}
        # Own, freshly allocated copies: a tensor loaded by safetensors can sit at any byte offset of
        # its buffer, and a matrix product rounds differently on memory aligned differently, so the
        # same classifier loaded from its cache, trained here or unpickled in a worker process would
        # give rewards a few ulps apart, and a seeded run would not repeat (apps/experiments/parallel.py).
        self.weight = weight.detach().clone(memory_format=torch.contiguous_format)
        self.bias = bias.detach().clone(memory_format=torch.contiguous_format)
        self.stats = stats

    def features(self, texts: list[str]) -> torch.Tensor:
        """[N, V] feature counts of each text scaled to unit L2 norm (zero rows stay zero)."""
        rows, cols, counts = [], [], []
        for row, text in enumerate(texts):
            for feature, count in Counter(text_features(text)).items():
                col = self.index.get(feature)
                if col is not None:
                    rows.append(row)
                    cols.append(col)
                    counts.append(float(count))
        x = torch.zeros(len(texts), len(self.vocab))
        x[rows, cols] = torch.tensor(counts)
        return torch.nn.functional.normalize(x, dim=1)

    def logits(self, texts: list[str]) -> torch.Tensor:
        """[N, S] unnormalised scores."""
        return self.features(texts) @ self.weight.T + self.bias

    @torch.no_grad()
    def probs(self, texts: list[str]) -> torch.Tensor:
        """[N, S] probability of each style (rows sum to 1)."""
        return torch.softmax(self.logits(texts), dim=1)

    def predict(self, texts: list[str]) -> list[str]:
        return [self.styles[i] for i in self.probs(texts).argmax(dim=1).tolist()]

    def accuracy(self, texts: list[str], styles: list[str]) -> float:
        """Share of ``texts`` whose predicted style is the given one."""
        if not texts:
            raise ValueError("accuracy of no texts")
        return sum(p == s for p, s in zip(self.predict(texts), styles)) / len(texts)

    def save(self, directory: Path, fingerprint: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}, directory / WEIGHTS_FILE)
        meta = {"fingerprint": fingerprint, "styles": list(self.styles), "vocab": self.vocab,
                "stats": asdict(self.stats) if self.stats else None}
        (directory / META_FILE).write_text(json.dumps(meta) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "StyleClassifier":
        meta = json.loads((directory / META_FILE).read_text())
        tensors = load_file(directory / WEIGHTS_FILE)
        stats = ClassifierStats(**meta["stats"]) if meta.get("stats") else None
        return cls(tuple(meta["styles"]), meta["vocab"], tensors["weight"], tensors["bias"], stats)


def fit(train: list[Example], styles: tuple[str, ...], seed: int, steps: int = TRAIN_STEPS) -> StyleClassifier:
    """Train the classifier on ``train`` answers of ``styles`` (other styles are left out)."""
    train = [e for e in train if e.style in styles]
    counts = Counter(f for e in train for f in text_features(e.answer))
    topics: dict[str, set[str]] = {}
    for e in train:
        for f in set(text_features(e.answer)):
            topics.setdefault(f, set()).add(e.topic)
    vocab = sorted(f for f, n in counts.items() if n >= FEATURE_MIN_COUNT and len(topics[f]) >= FEATURE_MIN_TOPICS)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.zeros(len(styles), len(vocab))
    weight.normal_(0.0, 0.01, generator=generator)
    bias = torch.zeros(len(styles))
    x = StyleClassifier(styles, vocab, weight, bias).features([e.answer for e in train])
    y = torch.tensor([styles.index(e.style) for e in train])
    weight, bias = weight.requires_grad_(), bias.requires_grad_()
    optimizer = torch.optim.AdamW([weight, bias], lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return StyleClassifier(styles, vocab, weight, bias)


def fingerprint(styles: tuple[str, ...], seed: int) -> dict:
    return {"format": CLASSIFIER_FORMAT, "corpus_version": CORPUS_VERSION, "styles": list(styles), "seed": seed,
            "heldout_fraction": HELDOUT_FRACTION}


def train_classifier(styles: tuple[str, ...], seed: int) -> StyleClassifier:
    """Fit on the training split of the seeded corpus and measure accuracy on the held-out split."""
    started = time.monotonic()
    train, heldout = split_heldout(generate_corpus(seed, styles=styles), HELDOUT_FRACTION, seed)
    model = fit(train, styles, seed)
    accuracy = model.accuracy([e.answer for e in heldout], [e.style for e in heldout])
    model.stats = ClassifierStats(len(train), len(heldout), accuracy, len(model.vocab), time.monotonic() - started)
    return model


def classifier_dir(cfg: AppConfig) -> Path:
    return cfg.data_dir / "models" / "style_classifier"


def load_or_train(cfg: AppConfig, progress: Progress = print) -> StyleClassifier:
    """The cached classifier of ``cfg.experiment.styles`` (seed ``model.base.seed``), trained if needed."""
    styles = tuple(cfg.experiment.styles)
    expected = fingerprint(styles, cfg.model.base.seed)
    directory = classifier_dir(cfg)
    meta_path = directory / META_FILE
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("fingerprint") == expected:
        model = StyleClassifier.load(directory)
        progress(f"style classifier loaded from {directory}")
        return model
    model = train_classifier(styles, cfg.model.base.seed)
    model.save(directory, expected)
    s = model.stats
    progress(f"style classifier: {s.vocab_size} features, {s.train_examples} training answers, held-out "
             f"accuracy {s.heldout_accuracy:.3f} on {s.heldout_examples} answers ({s.seconds:.1f}s)")
    return model
