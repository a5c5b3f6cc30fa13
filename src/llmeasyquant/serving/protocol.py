"""The OpenAI wire format: request models for /v1/completions and /v1/chat/completions, and the bodies sent back.

Requests are validated strictly (no string-to-number coercion; unknown fields refused): a field the server cannot
honour is an error naming it, never silently dropped, unless it changes nothing (`user`, `metadata`, `store`,
`service_tier`, `parallel_tool_calls`). Extensions beyond OpenAI's fields: `top_k` and `ignore_eos`.

Supported beyond plain sampling, as OpenAI defines them: `presence_penalty` and `frequency_penalty` ([-2, 2]),
`logit_bias` (token ids as string keys, biases in [-100, 100], at most 300 entries), log probabilities
(completions: `logprobs` 0..20; chat: `logprobs` true with `top_logprobs` 0..20) and `n` (1..16 choices). The
ranges are the engine's (runtime/requests.py), which names the field of a value out of range. Log probabilities
are those of the model's log-softmax after logit_bias and the penalties, before temperature, top-k and top-p; a
value below -9999 (an impossible token) is sent as -9999, since JSON has no -Infinity.

/v1/completions takes a list of prompts (strings or token id lists; each gets n choices, choice p * n + j is
prompt p's j-th) and `echo` (each choice's text starts with its prompt; with `logprobs`, the prompt's tokens come
first in them, scored by the model itself, the first with null value and alternatives). `max_tokens` 0 with echo
scores the prompt and generates nothing: what log-likelihood evaluations (lm-evaluation-harness's
`local-completions`) send. Still refused: `best_of` above 1, `suffix`, tools and function calls,
`response_format` other than text, non-text content parts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from llmeasyquant.runtime.requests import (
    MAX_BIAS_ENTRIES,
    MAX_CHOICES,
    MAX_LOGPROBS,
    RequestError,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from llmeasyquant.runtime.token_pieces import TokenPieces

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LOGPROB_FLOOR = -9999.0  # what a log probability of -inf (or below this) is sent as: JSON has no infinity
VOCAB_SIZE = "vocab_size"  # the validation context's key for the model's vocabulary size (logit_bias keys)
_TOKEN_ID = re.compile(r"-?[0-9]+")


def unsupported(field: str, why: str) -> ValueError:
    return ValueError(f"{field} is not supported by llmeasyquant serve: {why}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """The fields both endpoints share. `None` means OpenAI's default, as clients send nulls for unset fields."""

    # Optional, as vLLM, TGI and llama-server take it for their one model (OpenAI's API requires it): left out, the
    # served model; named, it must be that one.
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    # Accepted and ignored: none of them changes the text generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # OpenAI refuses stream_options on a request that does not stream; so do we.
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int | None) -> int | None:
        if n is not None and not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must lie in [1, {MAX_CHOICES}] (choices per request), got {n}")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        # JSON keys are strings: OpenAI's are token ids written as decimal integers. Their range is checked here
        # when the app passes the vocabulary size, and by the engine in any case.
        if value is not None and len(value) > MAX_BIAS_ENTRIES:  # counted as sent: "5" and "05" are two entries
            raise ValueError(f"logit_bias holds {len(value)} entries; at most {MAX_BIAS_ENTRIES} are allowed")
        vocab = (info.context or {}).get(VOCAB_SIZE)
        valid = f"token ids 0..{vocab - 1}" if vocab else "token ids"
        for key in value or {}:
            if not _TOKEN_ID.fullmatch(key) or (vocab and not 0 <= int(key) < vocab):
                raise ValueError(f"logit_bias: the key {key!r} is not a token id of this model: keys are {valid}, "
                                 "written as decimal integers")
        return value

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def choices(self) -> int:
        return self.n or 1

    def logprob_count(self) -> int | None:
        """Alternatives per token to send with log probabilities; None: no log probabilities."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token the engine scores; None: the prompt is not scored."""
        return None

    ZERO_MAX_TOKENS: ClassVar[str] = "max_tokens 0 generates nothing: ask for at least 1 token"

    def sampling(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; `check()` is the engine's range check (it names the field)."""
        if max_tokens == 0 and self.prompt_logprob_count() is None:
            raise RequestError(self.ZERO_MAX_TOKENS, "max_tokens")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=self.seed, stop=stop, ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
            logprobs=self.logprob_count(), prompt_logprobs=self.prompt_logprob_count())
        params.check()
        return params


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of /v1/completions' `prompt`: a string, a list of token ids, or a non-empty list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt is an empty list: send a string or a non-empty list of token ids")
    if all(_is_token(t) for t in prompt):
        return [prompt]
    if all(isinstance(p, str) or (isinstance(p, list) and all(_is_token(t) for t in p)) for p in prompt):
        return prompt
    raise ValueError("prompt must be a string, a list of integer token ids, or a list of prompts (strings or lists "
                     "of token ids)")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is a string, a list of token ids or a list of those (`prompts`)."""

    prompt: Any
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        return prompt_list(prompt)

    ZERO_MAX_TOKENS: ClassVar[str] = ("max_tokens 0 generates nothing: it is allowed only with echo true (the prompt "
                                      "scored, its log probabilities with logprobs); ask for at least 1 token")

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    def prompt_logprob_count(self) -> int | None:
        # Echoed with log probabilities, the prompt's tokens have theirs; max_tokens 0 scores it in any case.
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            return self.logprobs or 0
        return None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must lie in [0, {MAX_LOGPROBS}] (alternatives per token), got {logprobs}")
        return logprobs

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of not in (None, 1):
            raise unsupported(f"best_of={best_of}", "only best_of=1; leave it out (n gives several choices)")
        n = info.data.get("n") or 1
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of ({best_of}) must be at least n ({n}); leave best_of out")
        return best_of

    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise unsupported("suffix", "insertion is not implemented; leave it out")
        return suffix


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None  # accepted and ignored: chat templates leave it out

    @field_validator("content")
    @classmethod
    def _text(cls, content: Any) -> str:
        """A string, or a list of text parts (joined); images, audio and tool calls are refused."""
        if isinstance(content, str):
            return content
        if content is None:
            raise ValueError("content must be a string (assistant messages with tool calls are not supported)")
        if not isinstance(content, list):
            raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}")
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"a content part of type {kind!r}", "only text parts ({'type': 'text', "
                                  "'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)

    def as_dict(self) -> dict[str, str]:
        # The "developer" role is OpenAI's new name for "system"; chat templates know "system" only.
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # only means something with tools, which are refused

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if not info.data.get("logprobs"):  # as OpenAI refuses it
            raise ValueError("top_logprobs needs logprobs set to true")
        if not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must lie in [0, {MAX_LOGPROBS}], got {value}")
        return value

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if value:
            raise unsupported(info.field_name, "tool and function calling are not implemented; leave it out")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, "none"):
            raise unsupported(info.field_name, "tool and function calling are not implemented; leave it out")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise unsupported("response_format", f"got type {value.get('type')!r}; only {{'type': 'text'}}")
        return value

    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens (its older one)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a text's token ids, as the server tokenizes a string prompt."""

    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): the text of token ids, special tokens left out."""

    tokens: list[int]
    model: str | None = None

    @field_validator("tokens")
    @classmethod
    def _in_vocabulary(cls, tokens: list[int], info: ValidationInfo) -> list[int]:
        vocab = (info.context or {}).get(VOCAB_SIZE)
        bad = [t for t in tokens if vocab and not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return tokens


# Response bodies --------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_choice(index: int, text: str, finish_reason: str,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": logprobs}


def completion_body(id_: str, created: int, model: str, choices: list[dict[str, Any]],
                    usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}


def completion_chunk(id_: str, created: int, model: str, text: str, finish_reason: str | None, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": id_, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_body(id_: str, created: int, model: str, choices: list[dict[str, Any]],
              usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": id_, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}


def chat_chunk(id_: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None,
               index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": id_, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def _logprob(value: float) -> float:
    """A log probability JSON can carry: -inf (and NaN) become LOGPROB_FLOOR."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(entries: Sequence[TokenLogprob], pieces: TokenPieces, shift: int = 0,
                        first: int | None = None) -> dict[str, Any]:
    """/v1/completions' `logprobs` of some tokens: their strings, log probabilities, where their text starts in
    the completion (`shift` characters on: an echoed prompt before it), and per token a map of the likeliest tokens
    to their log probabilities, the generated token always among them (so up to logprobs + 1 entries, as
    OpenAI's). `first`: an echoed prompt's first token, which comes first with null log probability and map."""
    top = []
    for entry in entries:
        likeliest: dict[str, float] = {}
        for token, value in (*entry.top, (entry.token, entry.logprob)):
            likeliest.setdefault(pieces.text(token), _logprob(value))  # two tokens of one string: the likelier
        top.append(likeliest)
    head = [] if first is None else [None]
    return {"tokens": ([] if first is None else [pieces.text(first)]) + [pieces.text(e.token) for e in entries],
            "token_logprobs": head + [_logprob(e.logprob) for e in entries],
            "top_logprobs": head + top,
            "text_offset": ([] if first is None else [0]) + [shift + e.offset for e in entries]}


def joined_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Completion log probabilities of consecutive tokens (an echoed prompt's, then the completion's) as one."""
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}


def _chat_token(pieces: TokenPieces, token: int, value: float) -> dict[str, Any]:
    return {"token": pieces.text(token), "logprob": _logprob(value), "bytes": list(pieces.bytes(token))}


def chat_logprobs(entries: Sequence[TokenLogprob], pieces: TokenPieces) -> dict[str, Any]:
    """/v1/chat/completions' `logprobs` of some tokens: per token its string, log probability, bytes and its
    `top_logprobs` likeliest alternatives."""
    content = [_chat_token(pieces, e.token, e.logprob) | {"top_logprobs": [_chat_token(pieces, token, value)
                                                                            for token, value in e.top]}
               for e in entries]
    return {"content": content, "refusal": None}


def usage_chunk(object_: str, id_: str, created: int, model: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage is true: no choices, only the usage."""
    return {"id": id_, "object": object_, "created": created, "model": model, "choices": [], "usage": usage_}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "llmeasyquant"}
