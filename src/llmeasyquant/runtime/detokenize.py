"""Text from a growing list of token ids, one delta at a time, with stop strings cut and held back.

Decoding the ids one by one would break words and multi-byte characters that span tokens, and decoding them all
at every step costs the square of the length. So the text is decoded over a short window that starts a few tokens
before the new ones (`prefix`), and a delta is released only once it no longer ends in an incomplete character.
A stop string may arrive over several tokens: text that could still become one is held back until it cannot.

The window of the first new tokens starts in the prompt (`context`, its last few tokens, decoded but never
released): SentencePiece-style decoders drop the leading space of a text's first word, so decoding the new tokens
on their own would lose the space before the first word of every completion ("▁Paris" after "The capital is").

Log probabilities follow the text: each token's text starts where the text stood when it came (`starts`), and
`released_tokens` says how many tokens the released text accounts for, so that a token's log probability is sent
with its text, never before it, and never for a token a stop string cut off (runtime/token_pieces.py names the
tokens themselves).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to
CONTEXT_TOKENS = 4  # prompt tokens the first window starts with: enough that the first new token is mid-text


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), context: Sequence[int] = ()) -> None:
        """`context`: the prompt's ids (its last CONTEXT_TOKENS are used; none of their text is released)."""
        self.tokenizer, self.stop = tokenizer, stop
        self.ids = list(context)[-CONTEXT_TOKENS:]
        while self.ids and self._decode(self.ids).endswith(REPLACEMENT):
            self.ids.pop()  # a prompt that ends in half a character: its text would shift the first new token's
        self.prefix, self.read = 0, len(self.ids)  # ids[prefix:read] decode to text already known
        self.text = ""  # all text decoded so far (stop strings not yet cut)
        self.sent = 0  # characters of `text` released
        self.stopped = False
        self.starts: list[int] = []  # where each token's text starts in `text` (its end: the next one's start)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """Take one token; the text now safe to release (may be empty). Sets `stopped` when a stop string
        appeared (the text up to it is released, the stop string and what follows are not)."""
        self.ids.append(token)
        # A token whose character is incomplete adds no text now: its text is empty, the next token's holds it.
        self.starts.append(len(self.text))
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

    def released_tokens(self) -> int:
        """How many of the tokens taken so far the released text accounts for, from the first on.

        Before a stop string: the tokens whose text has been released in full. A token of empty text (half a
        character, a special token) goes with the next token that has text, as its text may hold back that token's
        too. After a stop string: the tokens whose text starts before it (a token whose text the stop string cut in
        two shows; one wholly in or after the stop string does not). At the end of a request that no stop string
        ended, every token counts (the caller knows that case: `len(ids)`)."""
        starts, sent = self.starts, self.sent
        if self.stopped:
            return bisect.bisect_left(starts, sent)
        count = bisect.bisect_right(starts, sent, 1) - 1  # token i ends where token i + 1 starts
        complete = self.read == len(self.ids)  # the last token's character is whole: its text is known
        if count == len(starts) - 1 and complete and len(self.text) <= sent:
            count += 1
        while 0 < count < len(starts) and starts[count - 1] == starts[count]:
            count -= 1
        return count


def text_starts(tokenizer, ids: Sequence[int]) -> list[int]:
    """Where each token's text starts in the text `ids` decode to (skipping special tokens), decoded the way a
    completion is: a token of half a character starts where the character does."""
    detokenizer = Detokenizer(tokenizer)
    for token in ids:
        detokenizer.add(token)
    return detokenizer.starts
