"""Incremental decoding and stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from serving.detokenize import IncrementalDecoder, StopStrings, decode_after


@pytest.mark.parametrize("text", ["plain words here", "Grüße, 世界! 🙂🙂 naïve café",
                                  "  spaces\n\nnew lines\t"])
def test_pieces_add_up_to_the_full_decode_and_never_split_a_character(chat_tokenizer, text):
    ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(chat_tokenizer)
    pieces = [decoder.push(t) for t in ids] + [decoder.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 1  # it really streams


def test_hidden_and_special_tokens_produce_no_text(chat_tokenizer):
    eos = chat_tokenizer.eos_token_id
    im_start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = chat_tokenizer("ab", add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(chat_tokenizer, hidden=frozenset({eos}))
    out = "".join(decoder.push(t) for t in [im_start, *ids, eos]) + decoder.finish()
    assert out == "ab"


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (the Metaspace pre-tokenizer and decoder of Llama 2, Mistral,
    Gemma): a word's space is the "▁" its first token begins with, and the decoder drops it from the
    first token of what it decodes."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    corpus = ["The capital of France is Paris and it is nice", "Paris is nice in spring", "the capital is big"]
    tokenizer.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


def test_with_a_sentencepiece_decoder_the_first_answer_token_keeps_its_space(metaspace_tokenizer):
    """Decoded alone, "▁Paris" is "Paris": a completion of "The capital of France is" came back as
    "Paris and it is nice", and the prompt plus it read "...France isParis"."""
    tok = metaspace_tokenizer
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    full = tok("The capital of France is Paris and it is nice", add_special_tokens=False)["input_ids"]
    assert full[:len(prompt)] == prompt
    decoder = IncrementalDecoder(tok, prompt=prompt)
    answer = "".join(decoder.push(t) for t in full[len(prompt):]) + decoder.finish()
    assert answer == " Paris and it is nice"


def test_a_records_response_text_keeps_the_first_tokens_space(metaspace_tokenizer, chat_tokenizer):
    """The record's response_text was the answer's ids decoded alone: "Paris and it is nice"."""
    tok = metaspace_tokenizer
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    full = tok("The capital of France is Paris and it is nice", add_special_tokens=False)["input_ids"]
    assert decode_after(tok, prompt, full[len(prompt):]) == " Paris and it is nice"
    assert decode_after(tok, [], full) == "The capital of France is Paris and it is nice"
    eos = tok.convert_tokens_to_ids("</s>")
    assert decode_after(tok, prompt, full[len(prompt):] + [eos]) == " Paris and it is nice</s>"  # special kept
    byte_level = chat_tokenizer("naïve caf", add_special_tokens=False)["input_ids"]
    answer = chat_tokenizer("é 🙂 done", add_special_tokens=False)["input_ids"]
    assert decode_after(chat_tokenizer, byte_level, answer) == "é 🙂 done"


def test_the_prompts_context_changes_nothing_for_a_byte_level_tokenizer(chat_tokenizer):
    prompt = chat_tokenizer("naïve caf", add_special_tokens=False)["input_ids"]
    ids = chat_tokenizer("é 🙂 done", add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(chat_tokenizer, prompt=prompt)
    assert "".join(decoder.push(t) for t in ids) + decoder.finish() == "é 🙂 done"


def test_a_prompt_cut_inside_a_character_leaves_the_answer_its_bytes(chat_tokenizer):
    """Token ids may cut a character (a prompt as ids, a parent cut at max_tokens): with the cut
    prompt as context, the answer's tokens that finish it gave no text at all."""
    ids = chat_tokenizer("ab \U0001f642 done", add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        decoder = IncrementalDecoder(chat_tokenizer, prompt=ids[:cut])
        alone = IncrementalDecoder(chat_tokenizer)
        expected = "".join(alone.push(t) for t in ids[cut:]) + alone.finish()
        assert "".join(decoder.push(t) for t in ids[cut:]) + decoder.finish() == expected, cut


def test_stop_string_cuts_the_text_and_nothing_of_it_is_emitted():
    stops = StopStrings(["END", "\n\n"])
    emitted = []
    for piece in ["Hel", "lo E", "N", "Dmore"]:
        out, hit = stops.feed(piece)
        emitted.append(out)
        if hit:
            break
    assert hit and "".join(emitted) == "Hello "
    assert all("E" not in e for e in emitted)  # the prefix of the stop string was held back


def test_without_a_hit_the_held_tail_is_flushed_at_the_end():
    stops = StopStrings(["STOP"])
    out = [stops.feed(p)[0] for p in ["abc", "ST", "O"]]
    assert "".join(out) == "abc"  # "STO" may still become "STOP"
    assert stops.flush() == "STO"


def test_the_earliest_stop_string_wins():
    out, hit = StopStrings(["cd", "b"]).feed("abcd")
    assert (out, hit) == ("a", True)


def test_no_stop_strings_passes_text_through():
    assert StopStrings([]).feed("anything") == ("anything", False)
