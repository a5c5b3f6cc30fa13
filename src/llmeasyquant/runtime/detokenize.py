"""Text from a growing list of token ids, one delta at a time, with stop strings cut and held back.

Decoding the ids one by one would break words and multi-byte characters that span tokens, and decoding them all
at every step costs the square of the length. So the text is decoded over a short window that starts a few tokens
before the new ones (`prefix`), and a delta is released only once it no longer ends in an incomplete character.
A stop string may arrive over several tokens: text that could still become one is held back until it cannot.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to text already released
        self.text = ""  # all text decoded so far (stop strings not yet cut)
        self.sent = 0  # characters of `text` released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """Take one token; the text now safe to release (may be empty). Sets `stopped` when a stop string
        appeared (the text up to it is released, the stop string and what follows are not)."""
        self.ids.append(token)
        window = self._decode(self.ids[self.prefix:])
        if window.endswith(REPLACEMENT):
            return ""  # the character continues in the next token
        known = self._decode(self.ids[self.prefix:self.read])
        self.text += window[len(known):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        end = len(self.text)
        if self.stop:
            lookback = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, lookback) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
            else:  # hold back a tail that a stop string could still start with
                end -= max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever was held back (no stop string completed)."""
        if self.stopped:
            return ""
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
