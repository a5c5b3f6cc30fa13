"""TokenPieces: single tokens' bytes and strings for byte-level, SentencePiece-style and byte-fallback vocabularies."""

from __future__ import annotations

import pytest
from tests.runtime.test_detokenize import BytesTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llmeasyquant.runtime.token_pieces import TokenPieces

TEXT = "The river flows past the old town. \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8. Caf\u00e9 cr\u00e8me."


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (as GPT-2's, Llama 3's, SmolLM2's) trained in code on a text with multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary (Llama 2's decoder) whose characters outside it fall back to <0xNN>."""
    vocab = {"<unk>": 0, "\u2581": 1, "a": 2, "\u2581a": 3, "b": 4, "<0xE6>": 5, "<0x97>": 6, "<0xA5>": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_byte_level_pieces_are_the_tokens_own_bytes() -> None:
    tokenizer = byte_level_tokenizer()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer(TEXT)["input_ids"]
    assert b"".join(pieces.bytes(t) for t in ids) == TEXT.encode("utf-8")
    halves = [t for t in ids if _not_utf8(pieces.bytes(t))]
    assert halves, "the text should have characters split across tokens"
    for token in halves:
        raw = pieces.bytes(token)
        assert pieces.text(token) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    whole = [t for t in ids if t not in halves]
    assert "".join(pieces.text(t) for t in whole) == "".join(pieces.bytes(t).decode() for t in whole)
    assert pieces.text(tokenizer.eos_token_id) == "<|end|>"


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_sentencepiece_pieces_keep_their_leading_space(tiny_tokenizer) -> None:
    pieces = TokenPieces(tiny_tokenizer)
    ids = tiny_tokenizer("The quick brown")["input_ids"]
    assert [pieces.text(t) for t in ids] == ["<s>", " The", " qu", "ick", " brown"]
    # Decoding a token alone drops its space (the decoder strips the text's first one): pieces do not.
    assert tiny_tokenizer.decode([ids[1]]) == "The"


def test_byte_fallback_pieces_are_their_byte() -> None:
    tokenizer = byte_fallback_tokenizer()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer("a\u65e5b", add_special_tokens=False)["input_ids"]
    assert ids == [3, 5, 6, 7, 4]
    assert [pieces.bytes(t) for t in ids] == [b" a", b"\xe6", b"\x97", b"\xa5", b"b"]
    assert pieces.text(5) == "bytes:\\xe6"


def test_other_tokenizers_are_read_by_decoding_each_token() -> None:
    pieces = TokenPieces(BytesTokenizer([b"x", "\u00e9".encode()]))
    assert pieces.bytes(1) == "\u00e9".encode() and pieces.text(0) == "x"


@pytest.mark.parametrize("token", [0, 3])
def test_pieces_are_cached(token: int) -> None:
    calls = []

    class Counting(BytesTokenizer):
        def decode(self, ids, **options):
            calls.append(ids)
            return super().decode(ids, **options)

    pieces = TokenPieces(Counting([b"a", b"b", b"c", b"d"]))
    assert pieces.text(token) == pieces.text(token) and pieces.bytes(token) == pieces.bytes(token)
    assert len(calls) == 1
