"""Single tokens as log probabilities name them (OpenAI's `token` and `bytes` fields): each token's own bytes, a
piece of a multi-byte character included, read off the vocabulary the way the tokenizer's decoder reads it."""

from __future__ import annotations

import json
import re


class TokenPieces:
    """Single tokens as log probabilities name them: the token's own bytes (a piece of a multi-byte character
    included), and a string of them (`bytes:\\xe6\\x97` where they are not whole UTF-8, as OpenAI writes them).

    The bytes come from the vocabulary's piece as the tokenizer's decoder maps it: byte-level pieces (GPT-2, Llama 3,
    SmolLM2) through the byte-to-character table, SentencePiece pieces with `▁` as a space and `<0xNN>` byte
    fallbacks; special tokens are their own text; any other tokenizer's through decoding the token alone. Cached
    per token; the tokenizer's decoder is inspected on first use only."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._kinds: set[str] | None = None
        self._special: dict[int, str] = {}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        raw = self._cache.get(token)
        if raw is None:
            raw = self._cache[token] = self._piece_bytes(token)
        return raw

    def text(self, token: int) -> str:
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _piece_bytes(self, token: int) -> bytes:
        if self._kinds is None:
            self._kinds = _decoder_kinds(self.tokenizer)
            added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            self._special = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        if token in self._special:
            return self._special[token].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token) if self._kinds else None
        if isinstance(piece, str):
            if "ByteLevel" in self._kinds and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            if "ByteFallback" in self._kinds and (match := _BYTE_PIECE.fullmatch(piece)):
                return bytes([int(match.group(1), 16)])
            if "Metaspace" in self._kinds:
                return piece.replace(METASPACE, " ").encode("utf-8")
        return self.tokenizer.decode([token], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False).encode("utf-8")


METASPACE = "\u2581"  # SentencePiece's word boundary, a space in the text
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(tokenizer) -> set[str]:
    """The kinds of piece decoding the tokenizer's decoder does: ByteLevel, ByteFallback, Metaspace (a `▁`-to-space
    Replace counts as Metaspace); empty for a tokenizer without a Hugging Face `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds: set[str] = set()
    pending = [json.loads(backend.to_str()).get("decoder") or {}]
    while pending:
        decoder = pending.pop()
        kind = decoder.get("type")
        if kind == "Sequence":
            pending.extend(decoder.get("decoders") or [])
        elif kind == "Replace" and (decoder.get("pattern") or {}).get("String") == METASPACE:
            kinds.add("Metaspace")
        elif kind in ("ByteLevel", "ByteFallback", "Metaspace"):
            kinds.add(kind)
    return kinds


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_UNICODE_TO_BYTE = _byte_level_table()
