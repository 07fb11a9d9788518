"""The ``bytes`` of each sampled token's log-prob entry: exact, whatever the tokenizer's family."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from serving.logprobs import TokenTexts


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's layout: "▁" for a space, a token per byte (``<0x00>``..``<0xFF>``) for what the
    vocabulary lacks, and a decoder that undoes both."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", "\u2581a", "a", "b", "\u2581b"]:
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a"), ("\u2581", "b")], unk_token="<unk>",
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_tokens_are_their_byte_and_spaces_are_kept():
    """Decoded alone, <0xF0> is U+FFFD (three other bytes) and "▁b" is "b": the bytes of "a 🙂 b"
    rebuilt from the entries were "a" and six replacement characters' worth."""
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer("a \U0001f642 b", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["\u2581a", "\u2581", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>",
                                                    "\u2581b"]
    entries = [TokenTexts(tokenizer).sampled(token, -1.0, ()) for token in ids]
    assert [entry.bytes for entry in entries] == [[32, 97], [32], [0xF0], [0x9F], [0x99], [0x82], [32, 98]]
    assert bytes(b for entry in entries for b in entry.bytes).decode() == " a \U0001f642 b"
    assert [entry.token for entry in entries][-1] == " b"


def test_a_special_token_is_its_own_text():
    tokenizer = byte_fallback_tokenizer()
    entry = TokenTexts(tokenizer).sampled(tokenizer.eos_token_id, -1.0, ())
    assert (entry.token, entry.bytes) == ("</s>", list(b"</s>"))


def test_completions_alternatives_of_one_text_keep_the_likeliest():
    """Byte-level tokens holding part of one character all read "\ufffd": the map keeps the first (likeliest)
    of a text, so it gives the sampled token the log-prob token_logprobs gives it."""
    from serving.answers import TokenLogprob, TopLogprob, completion_logprobs

    alternatives = [TopLogprob(token="\ufffd", logprob=-0.5), TopLogprob(token="\ufffd", logprob=-2.0),
                    TopLogprob(token="a", logprob=-3.0)]
    shaped = completion_logprobs([TokenLogprob(token="\ufffd", logprob=-0.5, top_logprobs=alternatives)], 0)
    assert shaped.token_logprobs == [-0.5]
    assert shaped.top_logprobs == [{"\ufffd": -0.5, "a": -3.0}]
