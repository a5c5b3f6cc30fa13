"""The server's Prometheus metrics, in a registry of its own per app (two apps in one process never share counts).

Counters and histograms are updated as requests run; the gauges (queue, batch, KV memory) are read from the engine
when /metrics is scraped, so they are never stale.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from llmeasyquant.runtime.engine import Engine
    from llmeasyquant.runtime.requests import TokenEvent

# ok: ended by a stop condition or max_tokens; cancelled: the client went away; shutdown: ended by SIGTERM's grace
# running out; error_4xx / error_5xx: answered with an error status (or, in a stream, an error event).
OUTCOMES = ("ok", "error_4xx", "error_5xx", "cancelled", "shutdown")
CAPACITY_TOKENS = 1024  # the sequence length the capacity gauge counts in

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmeasyquant_requests", "Requests to the API (every endpoint but /health and "
                                "/metrics), by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every outcome shows from the start, at 0
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("llmeasyquant_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("llmeasyquant_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("llmeasyquant_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("llmeasyquant_running_sequences", "Sequences in the running batch", registry=r)
        self.ttft = Histogram("llmeasyquant_time_to_first_token_seconds", "From a request's arrival to its first "
                              "generated token", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("llmeasyquant_inter_token_latency_seconds", "Between successive generated tokens of "
                             "a request", buckets=_ITL_BUCKETS, registry=r)
        self.kv_used = Gauge("llmeasyquant_kv_cache_used_bytes", "KV cache memory reserved by running sequences",
                             registry=r)
        self.kv_free = Gauge("llmeasyquant_kv_cache_free_bytes", "KV cache memory free", registry=r)
        self.kv_blocks_used = Gauge("llmeasyquant_kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("llmeasyquant_kv_cache_blocks_total", "KV cache blocks in all", registry=r)
        self.kv_capacity = Gauge("llmeasyquant_kv_capacity_sequences",
                                 f"Sequences of {CAPACITY_TOKENS:,} tokens the KV budget holds at once", registry=r)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self, engine: Engine) -> tuple[bytes, str]:
        """The text exposition, with the gauges read from the engine now."""
        stats = engine.stats()
        self.queue_depth.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_used.set(stats.kv_bytes_used)
        self.kv_free.set(stats.kv_bytes_total - stats.kv_bytes_used)
        self.kv_blocks_used.set(stats.blocks_used)
        self.kv_blocks_total.set(stats.blocks_total)
        self.kv_capacity.set(engine.kv_capacity(CAPACITY_TOKENS))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """One request's share of the metrics: tokens, time to first token and inter-token latency as its events
    arrive, then its outcome once. A request of n choices (OpenAI's `n`) has n streams of events: the tokens are
    summed over them, the time to first token is the first of any, inter-token latencies are each choice's own."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float, choices: int = 1) -> None:
        self.metrics = metrics
        self.arrival_s = arrival_s
        self.tokens = [0] * choices  # each choice's completion tokens so far
        self.finish_reasons: list[str | None] = [None] * choices
        self._last_token_s: list[float | None] = [None] * choices
        self._first_seen = False
        self._counted = False

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def finish_reason(self) -> str | None:
        """The request's: None while a choice runs; else the first of error, shutdown, cancelled that a choice
        ended with, or the first choice's reason."""
        reasons = self.finish_reasons
        if None in reasons:
            return None
        return next((r for r in ("error", "shutdown", "cancelled") if r in reasons), reasons[0])

    def see(self, event: TokenEvent, index: int = 0) -> None:
        new = event.completion_tokens - self.tokens[index]
        if new > 0:
            at = event.time_s or time.perf_counter()
            self.metrics.generation_tokens.inc(new)
            last = self._last_token_s[index]
            if not self._first_seen:
                self._first_seen = True
                self.metrics.ttft.observe(max(0.0, at - self.arrival_s))
            if last is not None:
                # An event can carry several tokens (text held back while it could still become a stop string):
                # the time since the last event is shared out evenly among them.
                gap = max(0.0, at - last) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            self._last_token_s[index] = at
            self.tokens[index] = event.completion_tokens
        if event.finish_reason is not None:
            self.finish_reasons[index] = event.finish_reason

    def outcome(self, outcome: str | None = None) -> None:
        """Count the request once: `outcome` if given, else from its finish reason (none seen: cancelled)."""
        if self._counted:
            return
        self._counted = True
        if outcome is None:
            reasons = self.finish_reasons
            # A choice that never ended was cancelled when its reader went; one that failed makes it a 5xx.
            reason = "error" if "error" in reasons else "cancelled" if None in reasons else self.finish_reason
            outcome = ("ok" if reason in ("stop", "length") else reason if reason in OUTCOMES else "error_5xx")
        self.metrics.count(outcome)
