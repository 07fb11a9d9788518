"""Build the project's default policy: a small Qwen2/Llama model trained from scratch on
the style corpus (apps/default_model/corpus.py) and a small tool-use part
(apps/default_model/tool_corpus.py: calculator calls, rendered with the model's own chat
template), with its own byte-level BPE tokenizer.

Nothing is downloaded. The result is a standard Hugging Face directory (config.json,
model.safetensors, tokenizer files with a ChatML chat template, generation_config.json)
plus ``online_sao_base_model.json``, which records what it was built from. A directory
whose record matches the configuration is reused as is; otherwise the model is rebuilt
in a temporary directory that replaces the old one only when complete.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config,
                          get_cosine_schedule_with_warmup)

from apps.config import AppConfig, BaseModelConfig
from online_sao.config import ConfigError
from apps.default_model.corpus import CORPUS_VERSION, Example, generate_corpus, split_heldout
from apps.default_model.tool_corpus import (TOOLS, ToolTask, generate_tool_corpus, tool_call_text,
                                            tool_corpus_size)

RECORD_FILE = "online_sao_base_model.json"
"""Written last into a built model directory: the fingerprint it was built from and its stats."""
BUILD_FORMAT = 4
"""Bumped when this builder changes what it produces, so older cached builds are rebuilt."""

END_OF_TEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, PAD)

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nYou may call these tools:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- (tool.function if tool.function is defined else tool) | tojson -}}"
    "{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nTo call one, answer with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.'"
    " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML: each turn is ``<|im_start|>role\\ncontent<|im_end|>\\n``; the generation prompt opens
an assistant turn, which the model closes with ``<|im_end|>`` (its eos token). With ``tools`` a
system turn lists them first; an assistant's tool calls follow its content as
``<tool_call>{"name", "arguments"}</tool_call>`` (what ``serving.tool_call_parser: hermes`` reads);
tool results are ``tool`` turns. Without tools the text is what the corpus was rendered as."""

PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""How text is split into words before BPE: the pattern transformers' Qwen2Tokenizer hard-codes."""

IGNORE_INDEX = -100
"""Label of tokens that carry no loss (the prompt and padding); transformers' convention."""
HELDOUT_FRACTION = 0.1
"""Prompts kept out of pre-training to measure held-out loss."""
WARMUP_FRACTION = 0.05
"""Share of pre-training steps spent warming the learning rate up."""
MAX_GRAD_NORM = 1.0
"""Gradient clipping of pre-training: from-scratch training at a high rate spikes early."""
LOG_EVERY = 50
"""Progress line every this many steps (and at the last step)."""
MAX_NEW_TOKENS = 64
"""Default generation length: corpus answers are under 60 tokens."""

Progress = Callable[[str], None]
Segments = list[tuple[str, bool]]
"""A training text in pieces, each with whether the model learns it (assistant turns) or only reads it."""
Row = tuple[list[int], list[int]]
"""(input_ids, labels) of one training sequence."""


@dataclass(frozen=True)
class BuildStats:
    """What a build measured; stored next to the fingerprint."""

    train_examples: int
    heldout_examples: int
    tool_examples: int
    """Of ``train_examples``, the tool-use trajectories (apps/default_model/tool_corpus.py)."""
    parameters: int
    final_train_loss: float
    heldout_loss: float
    seconds: float


def fingerprint(base: BaseModelConfig) -> dict:
    """Everything that determines the built model; equal fingerprints mean a reusable cache."""
    return {"build_format": BUILD_FORMAT, "corpus_version": CORPUS_VERSION, "base": base.model_dump(mode="json")}


def read_record(model_dir: Path) -> dict | None:
    """The build record of ``model_dir``, or None when it holds no completed build of ours."""
    path = model_dir / RECORD_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def is_built(model_dir: Path, base: BaseModelConfig) -> bool:
    """True when ``model_dir`` holds a complete model built from exactly this configuration."""
    record = read_record(model_dir)
    needed = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    return (record is not None and record.get("fingerprint") == fingerprint(base)
            and all((model_dir / name).is_file() for name in needed))


def chat_text(prompt: str, answer: str | None = None) -> str:
    """The corpus pair rendered exactly as :data:`CHAT_TEMPLATE` renders it (answer optional)."""
    text = f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"
    return text if answer is None else f"{text}{answer}{IM_END}\n"


def tools_system_text(tools: list[dict]) -> str:
    """The system turn :data:`CHAT_TEMPLATE` opens a conversation with when ``tools`` are offered."""
    listed = "".join(json.dumps(tool.get("function", tool), ensure_ascii=False) + "\n" for tool in tools)
    return (f"{IM_START}system\nYou may call these tools:\n<tools>\n{listed}</tools>\n"
            f'To call one, answer with <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>.{IM_END}\n')


def example_segments(example: Example) -> Segments:
    """A style pair: the prompt is read, the answer learned."""
    return [(chat_text(example.prompt), False), (example.answer + IM_END, True)]


def task_segments(task: ToolTask) -> Segments:
    """A tool-use trajectory rendered as :data:`CHAT_TEMPLATE` renders it with the calculator offered:
    the call and the final answer are learned; the system turn, question and tool result are read.
    The pieces are tokenised apart, as serving tokenises a continuation's observation apart from
    the sampled tokens."""
    return [(tools_system_text(TOOLS) + chat_text(task.question), False),
            (tool_call_text(task.expression) + IM_END, True),
            (f"\n{IM_START}tool\n{task.result}{IM_END}\n{IM_START}assistant\n", False),
            (task.answer + IM_END, True)]


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (rendered conversations), wrapped with the chat template.

    Normaliser and pre-tokeniser are the ones transformers' Qwen2Tokenizer imposes on
    load (NFC, :data:`PRETOKENIZE_REGEX` split, byte-level), so the saved tokenizer
    means the same whichever class an engine loads it with.
    """
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(sorted(set(texts)), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=IM_END, pad_token=PAD, unk_token=None, bos_token=None,
        additional_special_tokens=[END_OF_TEXT, IM_START], chat_template=CHAT_TEMPLATE,
        model_max_length=max_length, padding_side="right",
    )


def model_config(base: BaseModelConfig, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """A transformers config of the chosen architecture, sized by ``base``, ids from ``tokenizer``."""
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[base.architecture]
    return config_class(
        vocab_size=len(tokenizer), hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_layers, num_attention_heads=base.num_heads,
        num_key_value_heads=base.num_kv_heads, max_position_embeddings=base.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END), pad_token_id=tokenizer.pad_token_id,
    )


def encode_segments(tokenizer: PreTrainedTokenizerFast, rows: list[Segments], max_length: int) -> list[Row]:
    """(input_ids, labels) per row; labels ignore every piece that is only read."""
    texts = [text for row in rows for text, _ in row]
    ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"])
    out = []
    for row in rows:
        input_ids: list[int] = []
        labels: list[int] = []
        for _, learned in row:
            piece = next(ids)
            input_ids += piece
            labels += piece if learned else [IGNORE_INDEX] * len(piece)
        out.append((input_ids[:max_length], labels[:max_length]))
    return out


def with_learned_tokens(rows: list[Row], what: str, max_length: int, progress: Progress) -> list[Row]:
    """The rows of ``rows`` (cut to ``max_length``) that still hold a token to learn: a row cut before
    its first one would make a batch of nothing but ignored labels, whose loss is NaN (the build's
    logged and recorded loss with it). Cut rows are said, so a short ``max_position_embeddings``
    that leaves the tool-use rows without their answers is not silent."""
    cut = sum(len(ids) == max_length for ids, _ in rows)
    kept = [row for row in rows if any(label != IGNORE_INDEX for label in row[1])]
    if cut:
        progress(f"warning: {cut} of {len(rows)} {what} rows reach max_position_embeddings {max_length} (cut there "
                 f"if longer); {len(rows) - len(kept)} keep no token to learn and are left out")
    return kept


def encode_examples(tokenizer: PreTrainedTokenizerFast, examples: list[Example], max_length: int) -> list[Row]:
    """(input_ids, labels) per style example; labels ignore the prompt so only the answer is learned."""
    return encode_segments(tokenizer, [example_segments(e) for e in examples], max_length)


def collate_sequences(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: input_ids, attention_mask, labels, each [B, T]."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(lab)] = torch.tensor(lab)
        attention[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def epoch_batches(pool_sizes: list[int], batch_size: int, generator: torch.Generator) -> list[tuple[int, list[int]]]:
    """One pass over every pool in shuffled batches of one pool each: (pool, row indices) per batch.

    A batch pads to its longest row, so batches never mix pools of different lengths (a tool-use
    trajectory is about 145 tokens, a style pair 44: mixed batches would cost 2.4 times the
    padded tokens of a style-only build, pools apart cost 1.2 times); shuffling the batches of
    all pools together keeps each pool's share of the steps equal to its share of the rows.
    """
    batches = []
    for pool, size in enumerate(pool_sizes):
        order = torch.randperm(size, generator=generator).tolist()
        batches += [(pool, order[start:start + batch_size]) for start in range(0, size, batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def pretrain(model: PreTrainedModel, pools: list[list[Row]], base: BaseModelConfig,
             pad_id: int, generator: torch.Generator, progress: Progress) -> float:
    """Supervised training on the rows of ``pools`` for ``base.train_steps`` AdamW steps (cosine schedule).

    Returns the mean loss of the last logging window.
    """
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=base.learning_rate, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = get_cosine_schedule_with_warmup(optimizer, math.ceil(WARMUP_FRACTION * base.train_steps),
                                               base.train_steps)
    batches: list[tuple[int, list[int]]] = []
    window: list[float] = []
    started = time.monotonic()
    for step in range(1, base.train_steps + 1):
        if not batches:
            batches = epoch_batches([len(rows) for rows in pools], base.batch_size, generator)
        pool, indices = batches.pop()
        batch = collate_sequences([pools[pool][i] for i in indices], pad_id)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        schedule.step()
        window.append(loss.item())
        if step % LOG_EVERY == 0 or step == base.train_steps:
            progress(f"step {step}/{base.train_steps} loss {sum(window) / len(window):.4f} "
                     f"lr {schedule.get_last_lr()[0]:.2e} elapsed {time.monotonic() - started:.1f}s")
            last, window = sum(window) / len(window), []
    model.eval()
    return last


@torch.no_grad()
def mean_loss(model: PreTrainedModel, rows: list[Row], pad_id: int,
              batch_size: int = 64) -> float:
    """Token-weighted mean answer loss of ``rows``."""
    total, tokens = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = collate_sequences(rows[start:start + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        total += model(**batch).loss.item() * n
        tokens += n
    return total / max(tokens, 1)


def _train_into(directory: Path, base: BaseModelConfig, progress: Progress) -> BuildStats:
    # Seed a private copy of the global RNG: weight init draws from it, the caller's stream is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base.seed)
        return _seeded_train_into(directory, base, progress)


def _seeded_train_into(directory: Path, base: BaseModelConfig, progress: Progress) -> BuildStats:
    started = time.monotonic()
    generator = torch.Generator().manual_seed(base.seed)
    train, heldout = split_heldout(generate_corpus(base.seed), HELDOUT_FRACTION, base.seed)
    tasks = generate_tool_corpus(base.seed, tool_corpus_size(len(train)))
    progress(f"corpus: {len(train)} training and {len(heldout)} held-out answers, {len(tasks)} tool-use trajectories")
    style_segments = [example_segments(e) for e in train]
    tool_segments = [task_segments(t) for t in tasks]
    texts = ["".join(text for text, _ in row) for row in style_segments + tool_segments]
    trained = train_tokenizer(texts, base.vocab_size, base.max_position_embeddings)
    config = model_config(base, trained)
    trained.save_pretrained(directory)
    config.save_pretrained(directory)
    # Train on the ids of the tokenizer every engine will load (AutoTokenizer may pick an
    # architecture-specific class), so serving and training tokenise alike by construction.
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"tokenizer: {len(tokenizer)} tokens; model: {base.architecture}, {n_params:,} parameters")
    pad_id = tokenizer.pad_token_id
    length = base.max_position_embeddings
    pools = [with_learned_tokens(encode_segments(tokenizer, rows, length), what, length, progress)
             for rows, what in ((style_segments, "style"), (tool_segments, "tool-use"))]
    if not any(pools):
        raise ConfigError(f"model.base.max_position_embeddings {length} cuts every training row before its answer")
    final_loss = pretrain(model, pools, base, pad_id, generator, progress)
    heldout = with_learned_tokens(encode_examples(tokenizer, heldout, length), "held-out", length, progress)
    heldout_loss = mean_loss(model, heldout, pad_id)
    progress(f"held-out loss {heldout_loss:.4f}")
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)],
        pad_token_id=pad_id,
    )
    model.save_pretrained(directory)
    return BuildStats(len(train) + len(tasks), len(heldout), len(tasks), n_params, final_loss, heldout_loss,
                      time.monotonic() - started)


def _make_readable(directory: Path) -> None:
    """World-readable files: safetensors writes 0600, but serving may run as another user."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _replace_dir(built: Path, target: Path) -> None:
    """Move ``built`` to ``target``; an existing ``target`` is moved aside first, then removed."""
    stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
    if target.exists():
        os.rename(target, stale)
    os.rename(built, target)
    shutil.rmtree(stale, ignore_errors=True)


def build_base_model(cfg: AppConfig, force: bool = False, progress: Progress = print) -> Path:
    """The directory of the model to serve and train, building the default model if needed.

    A configured ``model.path`` is used as is (never written); it must hold a Hugging
    Face model. Otherwise the default model under ``data_dir/models/base`` is reused
    when its build record matches ``model.base`` (and ``force`` is False), and built
    otherwise. Concurrent builders serialise on a lock file next to the directory.
    """
    target = cfg.model_dir
    if cfg.model.path is not None:
        if not (target / "config.json").is_file():
            raise ConfigError(f"model.path {target} holds no Hugging Face model (no config.json)")
        progress(f"using the configured model {target}")
        return target
    base = cfg.model.base
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_built(target, base):
            progress(f"default model already built in {target}")
            return target
        # Holding the lock, any other build directory is debris of a killed builder.
        for debris in target.parent.glob(f".{target.name}.building-*"):
            shutil.rmtree(debris, ignore_errors=True)
        building = target.with_name(f".{target.name}.building-{os.getpid()}")
        try:
            stats = _train_into(building, base, progress)
            record = {"fingerprint": fingerprint(base), "stats": asdict(stats)}
            (building / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
            _make_readable(building)
            _replace_dir(building, target)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        progress(f"built the default model in {stats.seconds:.1f}s")
        return target


def run_base_model(cfg: AppConfig, force: bool = False) -> int:
    """``online-sao base-model``: build (or reuse) the default model; the last line is its directory."""
    print(build_base_model(cfg, force=force, progress=lambda line: print(line, flush=True)))
    return 0
