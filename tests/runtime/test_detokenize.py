"""The detokenizer's account of which tokens the released text covers (what log probabilities go out with)."""

from __future__ import annotations

from functools import partial

import pytest

from llmeasyquant.runtime.detokenize import Detokenizer


class BytesTokenizer:
    """Each id stands for fixed bytes; decode joins them and reads UTF-8 with replacement, as byte-level tokenizers
    do (half a character decodes to U+FFFD)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def feed(pieces: list[bytes], stop: tuple[str, ...] = ()) -> tuple[Detokenizer, list[tuple[str, int]]]:
    """Add every token; after each, the text released and how many tokens the released text covers."""
    detokenizer = Detokenizer(BytesTokenizer(pieces), stop)
    steps = []
    for token in range(len(pieces)):
        if detokenizer.stopped:
            break
        steps.append((detokenizer.add(token), detokenizer.released_tokens()))
    return detokenizer, steps


def test_without_stop_strings_each_token_goes_with_its_text() -> None:
    _, steps = feed([b"a", b"b", b" ", b"\xe6\x97", b"\xa5", b"c"])  # U+65E5 in two tokens
    assert steps == [("a", 1), ("b", 2), (" ", 3), ("", 3), ("\u65e5", 5), ("c", 6)]


def test_tokens_held_back_with_a_stop_prefix_come_later_in_order() -> None:
    detokenizer, steps = feed([b"ab", b"c", b"d", b" "], stop=("cx",))
    assert steps == [("ab", 1), ("", 1), ("cd", 3), (" ", 4)]  # "c" could start "cx": held, then let go
    assert not detokenizer.stopped and detokenizer.starts == [0, 2, 3, 4]


def test_tokens_a_stop_string_cuts_off_are_not_counted() -> None:
    detokenizer, steps = feed([b"ab", b"c", b"d", b" ", b"z"], stop=("d ",))
    assert detokenizer.stopped
    assert steps == [("ab", 1), ("c", 2), ("", 2), ("", 2)]  # "d" and " " make the stop string: never counted


def test_a_token_the_stop_string_cuts_in_two_counts() -> None:
    detokenizer, steps = feed([b"ab", b"cd", b"ef"], stop=("de",))
    assert detokenizer.stopped
    assert steps == [("ab", 1), ("c", 1), ("", 2)]  # "cd" shows in part ("c"): it counts; "ef" does not


def test_half_a_character_goes_with_the_token_that_completes_it() -> None:
    _, held = feed([b"a", b"\xe6\x97", b"\xa5", b"b"], stop=("\u65e5x",))
    assert held == [("a", 1), ("", 1), ("", 1), ("\u65e5b", 4)]  # the first half waits with the character
    detokenizer, cut = feed([b"a", b"\xe6\x97", b"\xa5", b"b"], stop=("\u65e5",))
    assert detokenizer.stopped and cut == [("a", 1), ("", 1), ("", 1)]  # both halves are in the stop string


@pytest.mark.parametrize("whole", ["the river flows past the town", "a quiet morning, then rain"])
def test_the_completion_is_what_the_whole_decodes_to_past_the_prompt(tiny_tokenizer, whole) -> None:
    """SentencePiece-style decoders drop the leading space of a text's first word: the first new token is decoded
    after the prompt's last tokens, so a completion that starts a word keeps its space (and one that starts the
    text has none, as decoding the whole says)."""
    ids = tiny_tokenizer.encode(whole)
    decode = partial(tiny_tokenizer.decode, skip_special_tokens=True)
    spaced = 0
    for split in range(1, len(ids)):  # the BOS alone, then every prompt the tokens allow
        context, new = ids[:split], ids[split:]
        detokenizer = Detokenizer(tiny_tokenizer, (), context)
        text = "".join(detokenizer.add(token) for token in new) + detokenizer.flush()
        assert text == decode(ids)[len(decode(context)):], split
        assert detokenizer.released_tokens() == len(new)
        spaced += text.startswith(" ")
    assert spaced >= 3  # the case this is about: completions that start a word


def test_a_prompt_ending_in_half_a_character_leaves_the_completion_whole() -> None:
    pieces = [b"a", b"\xe6\x97", b"\xa5", b"b"]  # the prompt [0, 1] ends inside U+65E5; the completion ends it
    detokenizer = Detokenizer(BytesTokenizer(pieces), (), [0, 1])
    # The prompt's own half is not taken as known text (which would shift the completion by a character): the
    # completion's half shows as one replacement character, and nothing after it is lost.
    assert detokenizer.add(2) + detokenizer.add(3) + detokenizer.flush() == "\ufffdb"
