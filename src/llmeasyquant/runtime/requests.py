"""What a caller hands the serving engine and what it gets back: sampling options, the events of one request's
stream, and the errors a request can meet (each with the HTTP status a server answers it with).

A leaf module: the engine (runtime/engine.py), the HTTP server (serving/) and the CLI all speak these types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmeasyquant.errors import LLMEasyQuantError

FINISH_REASONS = ("stop", "length", "cancelled", "shutdown", "error")  # error: the step failed (logged)


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


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. temperature 0 is greedy (argmax); top_k 0 and top_p 1 turn those filters off.
    `seed` makes sampling reproducible for the request (None: drawn from the engine's generator)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))

    def check(self) -> None:
        """Raise RequestError naming the first field out of range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and 0.0 <= self.temperature <= 2.0):
            raise RequestError(f"temperature must lie in [0, 2], got {self.temperature!r}", "temperature")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p!r}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if len(self.stop) > 4 or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop takes up to 4 non-empty strings", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's stream: the text decoded since the last event (held back while it could still
    become a stop string), the token ids it came from, and on the last event why the request ended."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    time_s: float = 0.0  # time.perf_counter() when the step that made it ended


@dataclass
class Completion:
    """A whole request's result, as Engine.generate returns it."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    time_to_first_token_s: float
    token_times_s: list[float] = field(default_factory=list)  # perf_counter() of each event

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
