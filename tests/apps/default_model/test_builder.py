"""The default model: built by our own code, standard HF layout, samples in several styles, cached."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from online_sao.config import ConfigError
from apps.default_model.builder import (IGNORE_INDEX, IM_END, RECORD_FILE, build_base_model, chat_text,
                                        encode_examples, encode_segments, epoch_batches, is_built, run_base_model,
                                        task_segments, with_learned_tokens)
from apps.config import load_app_config
from apps.default_model.corpus import STYLES, Example, StyleClassifier, generate_corpus, split_heldout
from apps.default_model.tool_corpus import TOOLS, ToolTask, task_messages

WORD = re.compile(r"[a-z']+")

# Small enough to train in seconds, large enough to learn the style frames: with a
# 600-token vocabulary or 60 steps it still babbles sub-word noise (measured: 1 in 32
# samples recognisable), which would make the diversity check meaningless. This one
# measured 22-23 of 32 recognisable, all four styles present, for seeds 0, 1 and 2.
SMALL_MODEL_OVERRIDES = {
    "model.base.vocab_size": 2048,
    "model.base.hidden_size": 64,
    "model.base.intermediate_size": 192,
    "model.base.num_layers": 2,
    "model.base.num_heads": 4,
    "model.base.num_kv_heads": 2,
    "model.base.max_position_embeddings": 128,
    "model.base.train_steps": 300,
    "model.base.batch_size": 32,
    "model.base.learning_rate": 5e-3,
}
SMALL_VOCAB = 2048
RECOGNISABLE_POSTERIOR = 0.9
"""The judge must put at least this probability on one style."""
RECOGNISABLE_KNOWN_WORDS = 0.9
"""At least this share of an answer's words must be corpus words (sub-word babble fails)."""


def small_config(data_dir: Path, **overrides):
    return load_app_config(environ={}, overrides={"paths.data_dir": str(data_dir), **SMALL_MODEL_OVERRIDES, **overrides})


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("base-model"))
    lines: list[str] = []
    return cfg, build_base_model(cfg, progress=lines.append), lines


@pytest.fixture(scope="module")
def judge() -> StyleClassifier:
    return StyleClassifier.fit(generate_corpus(seed=0))


def corpus_words() -> set[str]:
    return {w for e in generate_corpus(seed=0) for w in WORD.findall(f"{e.prompt} {e.answer}".lower())}


def recognisable_style(answer: str, judge: StyleClassifier, known: set[str]) -> str | None:
    """The judged style of ``answer`` when it is made of corpus words and the judge is sure; else None."""
    words = WORD.findall(answer.lower())
    if len(words) < 2 or sum(w in known for w in words) < RECOGNISABLE_KNOWN_WORDS * len(words):
        return None
    scores = judge.scores(answer)
    top = max(scores.values())
    posterior = 1.0 / sum(math.exp(v - top) for v in scores.values())
    return max(scores, key=scores.__getitem__) if posterior >= RECOGNISABLE_POSTERIOR else None


def sample_styles(model_dir: Path, prompts: list[str], per_prompt: int, judge: StyleClassifier,
                  seed: int) -> tuple[Counter, list[str]]:
    """Sample answers at temperature 1 through the AutoTokenizer chat template.

    Returns the count of recognisable answers per style (None counts the rest) and the answers.
    """
    known = corpus_words()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    styles, answers = Counter(), []
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        out = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=48, num_return_sequences=per_prompt)
        for row in out:
            answer = tokenizer.decode(row[inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            answers.append(answer)
            styles[recognisable_style(answer, judge, known)] += 1
    return styles, answers


def entropy_bits(counts: Counter) -> float:
    """Entropy of the style distribution of the recognisable answers."""
    total = sum(c for s, c in counts.items() if s is not None)
    return -sum(c / total * math.log2(c / total) for s, c in counts.items() if s is not None and c)


def heldout_prompts(n: int) -> list[str]:
    _, heldout = split_heldout(generate_corpus(seed=0), fraction=0.1, seed=0)
    prompts = sorted({e.prompt for e in heldout})
    return prompts[:: len(prompts) // n][:n]


def test_directory_is_a_standard_hf_model(small_model):
    cfg, model_dir, lines = small_model
    assert model_dir == cfg.data_dir / "models" / "base"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", RECORD_FILE):
        assert (model_dir / name).is_file(), name
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert any(line.startswith("step 300/300 loss") for line in lines)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    conversation = [{"role": "user", "content": "How do I make rice?"}]
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rendered == chat_text("How do I make rice?") == "<|im_start|>user\nHow do I make rice?<|im_end|>\n<|im_start|>assistant\n"
    full = conversation + [{"role": "assistant", "content": "Rinse it."}]
    assert tokenizer.apply_chat_template(full, tokenize=False) == chat_text("How do I make rice?", "Rinse it.")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tokenizer) == SMALL_VOCAB
    assert tokenizer.convert_tokens_to_ids(IM_END) in model.generation_config.eos_token_id


def assert_auto_tokenizer_matches_tokenizer_json(model_dir: Path) -> None:
    # transformers may load an architecture-specific tokenizer class (Qwen2Tokenizer
    # re-imposes its own pre-tokeniser); every engine must see the ids we trained on.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [chat_text(e.prompt, e.answer) for e in generate_corpus(seed=0)[::7]]
    texts.append("Odd  spacing\n\n  digits 12345, accents héllo, emoji \U0001F600, I'LL don't")
    for text in texts:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_auto_tokenizer_tokenises_like_the_trained_tokenizer(small_model):
    assert_auto_tokenizer_matches_tokenizer_json(small_model[1])


def test_training_reduced_the_loss(small_model):
    _, model_dir, _ = small_model
    stats = json.loads((model_dir / RECORD_FILE).read_text())["stats"]
    # Uniform guessing costs ln(2048) = 7.6 nats per token; this model measures 0.95-1.05 held out
    # (seeds 0-2).
    assert stats["final_train_loss"] < 2.0
    assert stats["heldout_loss"] < 2.0


def test_loss_is_on_the_answer_only(small_model):
    _, model_dir, _ = small_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    example = Example("How do I make rice?", "terse", "Rinse the grains.", "cooking")
    [(ids, labels)] = encode_examples(tokenizer, [example], max_length=128)
    assert len(ids) == len(labels)
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "Rinse the grains." + IM_END
    assert labels[: len(ids) - len(learned)] == [IGNORE_INDEX] * (len(ids) - len(learned))
    assert tokenizer.decode(ids) == chat_text(example.prompt, example.answer).rstrip("\n")


TASK = ToolTask(question="What is 17 plus 25?", expression="17 + 25", result="42", answer="17 plus 25 is 42.")


def test_tool_use_trajectory_is_rendered_like_the_chat_template(small_model):
    tokenizer = AutoTokenizer.from_pretrained(small_model[1])
    rendered = tokenizer.apply_chat_template(task_messages(TASK), tools=TOOLS, tokenize=False)
    assert rendered == "".join(text for text, _ in task_segments(TASK)) + "\n"
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "17 + 25"}}</tool_call>' in rendered


def test_tool_use_loss_is_on_the_call_and_the_final_answer_only(small_model):
    tokenizer = AutoTokenizer.from_pretrained(small_model[1])
    [(ids, labels)] = encode_segments(tokenizer, [task_segments(TASK)], max_length=1024)
    learned = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    assert learned == ('<tool_call>{"name": "calculator", "arguments": {"expression": "17 + 25"}}</tool_call>'
                       + IM_END + "17 plus 25 is 42." + IM_END)
    read = tokenizer.decode([t for t, label in zip(ids, labels) if label == IGNORE_INDEX])
    assert "What is 17 plus 25?" in read and "tool\n42" in read and "</tools>" in read


def test_epoch_batches_keep_pools_apart_and_cover_every_row():
    batches = epoch_batches([70, 9], batch_size=8, generator=torch.Generator().manual_seed(0))
    assert sorted(i for pool, rows in batches if pool == 0 for i in rows) == list(range(70))
    assert sorted(i for pool, rows in batches if pool == 1 for i in rows) == list(range(9))
    assert [len(rows) for pool, rows in batches].count(8) == 9
    assert [pool for pool, _ in batches] != sorted(pool for pool, _ in batches)  # shuffled across pools


def test_sampled_answers_cover_several_styles(small_model, judge):
    _, model_dir, _ = small_model
    styles, answers = sample_styles(model_dir, heldout_prompts(8), per_prompt=4, judge=judge, seed=0)
    # Most answers must be recognisable at all: an untrained or under-trained model
    # babbles and is judged "some style" at random, which would look diverse.
    assert styles[None] <= len(answers) // 2, (styles, answers)
    # A model that collapsed onto one style scores 0 bits; four styles in equal shares
    # score 2 bits. More than 0.8 bits over at least two styles rules out one style
    # with a few stray answers (14 of 16 in one style is 0.54 bits).
    recognised = [s for s in STYLES if styles[s]]
    assert len(recognised) >= 2 and entropy_bits(styles) > 0.8, (styles, answers)


def test_second_build_is_reused_without_training(small_model):
    cfg, model_dir, _ = small_model
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    lines: list[str] = []
    assert build_base_model(cfg, progress=lines.append) == model_dir
    assert weights.stat().st_mtime_ns == before
    assert not any(line.startswith("step") for line in lines)
    assert is_built(model_dir, cfg.model.base)
    assert not is_built(model_dir, cfg.model.base.model_copy(update={"train_steps": 61}))


def test_cli_prints_the_directory_last(small_model, capsys):
    cfg, model_dir, _ = small_model
    assert run_base_model(cfg) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(model_dir)


def test_configured_model_directory_is_used_as_is(small_model, tmp_path):
    _, model_dir, _ = small_model
    cfg = small_config(tmp_path, **{"model.path": str(model_dir)})
    assert build_base_model(cfg, progress=lambda _: None) == model_dir
    assert not (tmp_path / "models").exists()
    missing = small_config(tmp_path, **{"model.path": str(tmp_path / "nothing")})
    with pytest.raises(ConfigError, match="no config.json"):
        build_base_model(missing, progress=lambda _: None)


def test_same_seed_builds_identical_weights(tmp_path):
    overrides = {"model.base.train_steps": 3, "model.base.hidden_size": 32, "model.base.intermediate_size": 64}
    first = build_base_model(small_config(tmp_path / "a", **overrides), progress=lambda _: None)
    second = build_base_model(small_config(tmp_path / "b", **overrides), progress=lambda _: None)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()


def test_llama_architecture_builds_and_loads(tmp_path):
    overrides = {"model.base.architecture": "llama", "model.base.train_steps": 2, "model.base.hidden_size": 32,
                 "model.base.intermediate_size": 64}
    model_dir = build_base_model(small_config(tmp_path, **overrides), progress=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=4)
    assert out.shape[1] <= inputs["input_ids"].shape[1] + 4
    assert_auto_tokenizer_matches_tokenizer_json(model_dir)


@pytest.mark.slow
def test_default_model_answers_in_at_least_three_styles(tmp_path_factory, judge):
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path_factory.mktemp("default"))})
    model_dir = build_base_model(cfg)
    styles, answers = sample_styles(model_dir, heldout_prompts(16), per_prompt=4, judge=judge, seed=0)
    assert styles[None] <= len(answers) // 4, (styles, answers)
    assert sum(1 for s in STYLES if styles[s] >= 4) >= 3, (styles, answers)
    assert entropy_bits(styles) > 1.5, (styles, answers)


def test_rows_cut_before_their_answer_are_left_out_and_said():
    """max_position_embeddings 64 cut every tool-use row before its first learned token: batches of
    such rows had a NaN loss, and the build recorded final_train_loss NaN without a word."""
    said: list[str] = []
    rows = [([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4]),
            ([5, 6, 7, 8], [IGNORE_INDEX] * 4),
            ([9, 10], [IGNORE_INDEX, 10])]
    assert with_learned_tokens(rows, "tool-use", 4, said.append) == [rows[0], rows[2]]
    assert said == ["warning: 2 of 3 tool-use rows reach max_position_embeddings 4 (cut there if longer); "
                    "1 keep no token to learn and are left out"]
    said.clear()
    assert with_learned_tokens(rows[2:], "style", 4, said.append) == rows[2:] and said == []
