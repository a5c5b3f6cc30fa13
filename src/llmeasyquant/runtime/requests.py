"""What a caller hands the serving engine and what it gets back: sampling options, the events of one request's
stream, and the errors a request can meet (each with the HTTP status a server answers it with).

A leaf module: the engine (runtime/engine.py), the HTTP server (serving/) and the CLI all speak these types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmeasyquant.errors import LLMEasyQuantError

FINISH_REASONS = ("stop", "length", "cancelled", "shutdown", "error")  # error: the step failed (logged)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_BIAS = 100.0  # a logit_bias value lies in [-100, 100], as OpenAI's
MAX_BIAS_ENTRIES = 300  # logit_bias entries per request: a per-token list the size of a vocabulary is no "bias"
MAX_LOGPROBS = 20  # alternatives per token with their log probabilities (OpenAI's chat limit, vLLM's default)
MAX_CHOICES = 16  # completions per request (n); each is a sequence of its own in the engine
# Stop strings per request. OpenAI takes 4; evaluation harnesses send more (lm-evaluation-harness adds the
# end-of-sequence text to a task's own list), vLLM and llama-server take any number. Each costs a search of the
# held-back text per token.
MAX_STOPS = 16
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class RequestError(LLMEasyQuantError, ValueError):
    """A request that cannot be served as asked: the message names the field and the fix."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(RequestError):
    """Every running slot is taken and the waiting queue is at --max-queue: try again later."""

    status = 429

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class EngineStopped(RequestError):
    """The engine is shutting down and takes no new request."""

    status = 503


def _number_in(value: object, low: float, high: float) -> bool:
    """A finite real number (not a bool) within [low, high]."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. temperature 0 is greedy (argmax); top_k 0 and top_p 1 turn those filters off.
    `seed` makes sampling reproducible for the request (None: drawn from the engine's generator).

    Before the choice (greedy included), each logit gets its `logit_bias` (token id -> bias in [-100, 100]) and
    loses `presence_penalty` if the token was generated already in this completion plus `frequency_penalty` times
    the number of times it was (both in [-2, 2], OpenAI's definition); temperature, top-k and top-p come after.
    `logprobs` (0..20, None: off) asks for each generated token's log probability and that many likeliest
    alternatives, from the log-softmax of those biased and penalised logits, before temperature, top-k and top-p.
    Requests that ask for none of these are decoded exactly as without them, at no cost.

    `prompt_logprobs` (0..20, None: off) asks for each prompt token's log probability given the tokens before it
    (from the model's own log-softmax: no bias, penalty or temperature) and that many likeliest alternatives, as
    scoring a text needs (perplexity, log-likelihood evaluations). With it, `max_tokens` may be 0: the prompt is
    scored and nothing is generated."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Given as a mapping {token id: bias}; kept as a tuple of pairs so that the params stay immutable.
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((bias.items() if isinstance(bias, Mapping) else bias) or ()))

    def check(self, vocab_size: int | None = None) -> None:
        """Raise RequestError naming the first field out of range; with `vocab_size`, logit_bias's token ids are
        checked against it too."""
        scoring = self.prompt_logprobs is not None
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1 - scoring:
            raise RequestError(f"max_tokens must be a positive integer (0 only to score the prompt, with prompt "
                               f"log probabilities), got {self.max_tokens!r}", "max_tokens")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and 0.0 <= self.temperature <= 2.0):
            raise RequestError(f"temperature must lie in [0, 2], got {self.temperature!r}", "temperature")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p!r}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise RequestError(f"seed must lie in [-2**63, 2**64 - 1], got {self.seed}", "seed")
        if len(self.stop) > MAX_STOPS:
            raise RequestError(f"stop takes up to {MAX_STOPS} strings, got {len(self.stop)}", "stop")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop takes non-empty strings only", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number_in(getattr(self, name), -MAX_PENALTY, MAX_PENALTY):
                raise RequestError(f"{name} must lie in [-2, 2], got {getattr(self, name)!r}", name)
        self._check_bias(vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or left out), got {value!r}",
                                   name)

    def _check_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_BIAS_ENTRIES:
            raise RequestError(f"logit_bias holds {len(self.logit_bias)} entries; at most {MAX_BIAS_ENTRIES} are "
                               "allowed", "logit_bias")
        last = f"0..{vocab_size - 1}" if vocab_size else "the vocabulary"
        for entry in self.logit_bias:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise RequestError(f"logit_bias must map token ids to biases, got the entry {entry!r}", "logit_bias")
            token, bias = entry
            if isinstance(token, bool) or not isinstance(token, int) or \
                    (vocab_size is not None and not 0 <= token < vocab_size):
                raise RequestError(f"logit_bias: the key {token!r} is not a token id of this model ({last})",
                                   "logit_bias")
            if not _number_in(bias, -MAX_BIAS, MAX_BIAS):
                raise RequestError(f"logit_bias: the bias of token {token} must lie in [-100, 100], got {bias!r}",
                                   "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits change before the choice (a bias or a penalty): the request carries an offset."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability, its likeliest alternatives and where its text starts.

    `top` holds the `logprobs` likeliest tokens of the step (the generated one among them or not), most likely
    first. `offset` is the character in the completion's text where the token's text begins (for a prompt token:
    in the prompt's decoded text)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    offset: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's stream: the text decoded since the last event (held back while it could still
    become a stop string), the token ids it came from, and on the last event why the request ended.

    `logprobs` (requests that asked for them, else None) are those of the tokens whose text this event releases:
    they are held back with the text, come once each and in order, and those of tokens a stop string cut off never
    come. So they need not match `token_ids`, which are the tokens generated at this step.

    `prompt_logprobs` (requests that asked for them, on their first event only, else None): one per prompt token
    after the first (nothing comes before the first to predict it)."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    time_s: float = 0.0  # time.perf_counter() when the step that made it ended
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class Completion:
    """A whole request's result, as Engine.generate returns it."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    time_to_first_token_s: float
    token_times_s: list[float] = field(default_factory=list)  # perf_counter() of each event
    logprobs: list[TokenLogprob] | None = None  # one per token of `text` when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, when asked for

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health and /metrics."""

    running: int
    waiting: int
    max_running: int
    max_queue: int
    kv_bytes_used: int
    kv_bytes_total: int
    kv_kind: str  # "float16", "float32" or "k4v4"-style quantized cache name
    block_size: int
    blocks_used: int
    blocks_total: int
    steps: int
    accepting: bool
