"""The serving engine: requests in, token streams out, with continuous batching over the lean decoder.

One background thread runs steps. Each step:
1. ends the sequences whose clients cancelled, giving their slots and KV blocks back;
2. admits waiting requests in arrival order while a slot is free and the KV pool can reserve blocks for the prompt
   and all `max_tokens` (runtime/kv_pool.py), so an admitted request never waits for memory again;
3. runs one forward over the rows of every running sequence (runtime/batch.py): one row per decoding sequence, and
   prompt chunks of prefilling ones. Prefill is chunked: a prompt runs in chunks whose ends are aligned to
   multiples of `prefill_chunk` positions, at most `prefill_chunk` prompt tokens a step over all sequences, so a
   long prompt delays the decoding sequences by one chunk's work per step, never by the whole prompt, and prompts
   that arrive together (within the default budget) are prefilled in one step. Aligned chunks cut a prompt at the
   same positions whatever runs beside it;
4. chooses every sequence's next token at once (runtime/sampling.py: a constant number of tensor operations
   whatever the batch; each sampled request draws from its own seeded generator, its logit_bias and penalties
   added to its row alone), then, outside the lock, detokenizes each token, cuts stop strings and pushes an event
   to the request's stream: the lock is taken only to give the slots of the sequences that ended back, so
   submitting requests and reading stats never wait for the detokenizers. Sequences that asked for prompt log
   probabilities also get the logits of every row of their prompt chunks (the same forward; only those rows pass
   the LM head) and score each prompt token with the row before it.
Requests join and leave the batch at every step. The queue is bounded (`max_queue`): beyond it submit raises
QueueFull, which a server answers with 429. `submit_many` queues n completions of one prompt (OpenAI's `n`) as n
sequences, `submit_prompts` n completions of each of several prompts (OpenAI's list of prompts), all of them or
none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.runtime.batch import BatchDecoder
from llmeasyquant.runtime.detokenize import Detokenizer, text_starts
from llmeasyquant.runtime.kv_pool import MIB, FloatPool, KVPool, QuantPool, Shape
from llmeasyquant.runtime.model_parts import DecoderParts
from llmeasyquant.runtime.model_thread import ModelThread
from llmeasyquant.runtime.requests import (
    MAX_CHOICES,
    SEED_RANGE,
    Completion,
    EngineStats,
    EngineStopped,
    QueueFull,
    RequestError,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)
from llmeasyquant.runtime.sampling import RequestSampler, choose_tokens, token_logprobs
from llmeasyquant.runtime.token_pieces import TokenPieces

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 4096
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class EngineConfig:
    kv_memory_mb: float = 256.0
    kv_bits: int | None = None  # None: float cache in kv_dtype (or the checkpoint's SimQuant cache); 2/3/4/8: codes
    kv_dtype: str = "float16"  # float cache storage: "float16" or "float32"
    max_running: int = 16  # sequences decoded together at most
    max_queue: int = 64  # requests waiting beyond those; more -> QueueFull
    # Prompt tokens prefilled per step over all sequences (chunked prefill). 2048, llama-server's batch: requests
    # that arrive together are prefilled in one step and then decode in step, where a small budget spreads their
    # prompts over many steps beside the first ones' decode rows (at 64, 16 streams' inter-token latency p99 was
    # 4.7x its p50 against 1.9x, and throughput 6% lower: docs/RESULTS.md). A smaller value bounds how long one long
    # prompt stalls the running streams.
    prefill_chunk: int = 2048
    max_context: int | None = None  # prompt + completion tokens per request (None: the model's, at most 4096)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be 0 or more, got {self.max_queue}")
        if not self.kv_memory_mb > 0:
            raise ConfigError(f"the KV memory must be positive (MiB), got {self.kv_memory_mb}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context must be at least 2 tokens, got {self.max_context}")


class RequestStream:
    """The events of one request, readable from a thread (`for event in stream`) or from an event loop
    (`async for event in stream`). `cancel()` asks the engine to end it at its next step."""

    def __init__(self, request_id: str, prompt_ids: list[int]) -> None:
        self.id, self.prompt_ids, self.prompt_tokens = request_id, prompt_ids, len(prompt_ids)
        self.cancelled = False
        self._lock = threading.Condition()
        self._events: deque[TokenEvent] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[TokenEvent] | None = None
        self._wake: threading.Event | None = None  # set by the engine's cancel hook
        self.finished = False

    def push(self, event: TokenEvent) -> None:
        with self._lock:
            if event.finish_reason is not None:
                self.finished = True
            if self._queue is not None:
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads this stream any more
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
                return
            self._events.append(event)
            self._lock.notify_all()

    def cancel(self) -> None:
        self.cancelled = True
        if self._wake is not None:
            self._wake.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._lock:
                while not self._events:
                    self._lock.wait()
                event = self._events.popleft()
            yield event
            if event.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._async_events()

    async def _async_events(self) -> AsyncIterator[TokenEvent]:
        with self._lock:
            self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
            while self._events:
                self._queue.put_nowait(self._events.popleft())
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason is not None:
                return


@dataclass
class _Sequence:
    stream: RequestStream
    params: SamplingParams
    prompt: list[int]
    detokenizer: Detokenizer  # touched by the engine's thread alone, outside the lock
    sampler: RequestSampler  # its seeded generator, logit_bias and penalties
    slot: int = -1
    prefilled: int = 0  # prompt positions in the cache
    tokens: list[int] = field(default_factory=list)  # generated ids (the last one not yet in the cache)
    logprobs: list[TokenLogprob] | None = None  # one per token given to the detokenizer, when asked for
    logprobs_sent: int = 0  # how many of them have gone out in events
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, when asked for
    prompt_offsets: list[int] = field(default_factory=list)  # where each prompt token's text starts
    prompt_logprobs_sent: bool = False  # they go out once, with the first event

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt log probabilities for the sequence's first event (None after it, or when not asked for)."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)


class Engine:
    """Continuous batching over one model (see the module docstring). `submit` is thread-safe."""

    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig | None = None, name: str = "model",
                 runner: ModelThread | None = None) -> None:
        config = config or EngineConfig()
        if tokenizer is None:
            raise ConfigError("serving needs the model's tokenizer; this model or checkpoint has none")
        self.model, self.tokenizer, self.config, self.name = model.eval(), tokenizer, config, name
        limit = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_CONTEXT
        self.max_context = config.max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if self.max_context > limit:
            raise ConfigError(f"max_context {self.max_context} is past the model's {limit} positions")
        parts = DecoderParts(model, self.max_context)
        if parts.dtype != torch.float32:
            raise ConfigError(f"the serving engine runs fp32 models; this one is {parts.dtype}: load it in float32")
        self.pool = self._pool(parts)
        self.decoder = BatchDecoder(parts, self.pool)
        started = time.perf_counter()
        # A step holds at most every running sequence's row and a prompt chunk; the head reads one row a sequence.
        self.decoder.prepare(config.max_running + config.prefill_chunk, config.max_running)
        log.info("kernels chosen and native steps built for steps of up to %d rows in %.1f s",
                 config.max_running + config.prefill_chunk, time.perf_counter() - started)
        self.vocab = int(model.config.vocab_size)
        self.eos = _eos_ids(model, tokenizer)
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._accepting = True
        self._deadline: float | None = None  # set by shutdown: running requests end by then
        # The thread the loop runs on: the one the model was loaded on where Engine.load made it
        # (runtime/model_thread.py: one OpenMP team in the process), else one of the engine's own.
        self._runner = runner
        self._looping: Future | None = None
        self._steps = 0
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        log.info("serving %s: %s KV cache, %.0f MiB, %d blocks of %d positions, %d sequences of 1,024 tokens fit",
                 name, self.pool.kind, config.kv_memory_mb, self.pool.num_blocks, self.pool.block_size,
                 self.pool.capacity(1024))

    def _pool(self, parts: DecoderParts) -> KVPool:
        shape = Shape(len(parts.blocks), parts.kv_heads, parts.head_dim, parts.heads)
        budget = int(self.config.kv_memory_mb * MIB)
        kv = self._kv_config()
        if kv is None:
            return FloatPool(shape, budget, self.config.max_running, self.max_context, self.config.kv_dtype)
        if kv.key_channels:
            log.info("the serving KV pool codes keys on each block's own range; the %d calibrated fp16 key "
                     "channels of the offline cache are not kept", kv.key_channels)
        if kv.compact:
            log.info("the serving KV pool stores its side information in its own layout; the offline cache's "
                     "compact side information is not used")
        return QuantPool(shape, budget, self.config.max_running, self.max_context, kv, parts.cos, parts.sin)

    def _kv_config(self):
        from llmeasyquant.nn.kv.config import KVQuantConfig

        if self.config.kv_bits is not None:
            return KVQuantConfig(key_bits=self.config.kv_bits, value_bits=self.config.kv_bits)
        spec = getattr(getattr(self.model, "llmeasyquant", None), "kv_cache", None)
        if spec is not None:
            log.info("the checkpoint was quantized with a %s KV cache; serving with it", spec.config.name)
            return spec.config
        return None

    @classmethod
    def load(cls, spec: str, config: EngineConfig | None = None, name: str | None = None) -> Engine:
        """An engine over a checkpoint folder or a model spec (such as smollm2-135m), loaded on the thread its loop
        will run on (runtime/model_thread.py says why)."""
        from llmeasyquant.export.checkpoint import is_checkpoint, load
        from llmeasyquant.models.load import load_model
        from llmeasyquant.nn.fused import fuse_shared_inputs
        from llmeasyquant.nn.placement import place_on_huge_pages

        threads = torch.get_num_threads()

        def build() -> Engine:
            torch.set_num_threads(threads)  # the caller's setting (OpenMP keeps it per thread)
            model, tokenizer = load(spec) if is_checkpoint(spec) else load_model(spec)
            fuse_shared_inputs(model)  # q/k/v and gate/up as one GEMM each: the same results, fewer calls
            place_on_huge_pages(model)  # each decode step streams the weights: fewer TLB misses on 2 MiB pages
            return cls(model, tokenizer, config, name or (Path(spec).name if is_checkpoint(spec) else str(spec)),
                       runner)

        runner = ModelThread()
        return runner.call(build)

    # requests ----------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})", "prompt")
        else:
            raise RequestError("the prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        return ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids of a conversation through the tokenizer's chat template, ending with the assistant's
        turn to speak."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model's tokenizer has no chat template; use the completions endpoint",
                               "messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content}", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES \
                    or not isinstance(message.get("content"), str):
                raise RequestError(f"messages[{i}] must have a role ({', '.join(CHAT_ROLES)}) and a string content",
                                   "messages")
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text, as a string prompt is tokenized (with the tokenizer's special tokens, such as
        BOS, unless `add_special_tokens` is False)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens left out (as completions are decoded)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @functools.cached_property
    def token_pieces(self) -> TokenPieces:
        """Single tokens' bytes and strings, for answers with log probabilities."""
        return TokenPieces(self.tokenizer)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestStream:
        """Queue a request; its stream of events. Raises RequestError (with the field) for a request that cannot
        run, QueueFull when the queue is at max_queue, EngineStopped after shutdown."""
        return self.submit_many(prompt, params, 1)[0]

    def submit_many(self, prompt: str | list[int], params: SamplingParams | None = None,
                    n: int = 1) -> list[RequestStream]:
        """Queue n completions of one prompt (1 <= n <= MAX_CHOICES), each a sequence of its own; their streams,
        in order. All are queued or none: QueueFull when the queue cannot take those that would wait. With a
        seed, completion i samples with seed + i (so the first is what n=1 gives, and the request repeats);
        without, each draws its own seed. Greedy completions are all the same. Errors as `submit`."""
        return self.submit_prompts([prompt], params, n)[0]

    def submit_prompts(self, prompts: Sequence[str | list[int]], params: SamplingParams | None = None,
                       n: int = 1) -> list[list[RequestStream]]:
        """Queue n completions of each prompt, as `submit_many` does for one; per prompt, its n streams. All of
        them are queued or none. A prompt that cannot run is a RequestError that names it by its index."""
        params = params or SamplingParams()
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
        params.check(self.vocab)
        if not prompts:
            raise RequestError("no prompt was given: send at least one", "prompt")
        count, most = n * len(prompts), self.config.max_running + self.config.max_queue
        if count > most:
            what = f"n={n} completions" if len(prompts) == 1 else f"{len(prompts)} prompts x n={n} completions"
            raise RequestError(f"{what} can never be queued together: this server runs {self.config.max_running} "
                               f"and queues {self.config.max_queue} requests at most; ask for at most {most}",
                               "n" if len(prompts) == 1 else "prompt")
        groups = []
        for index, prompt in enumerate(prompts):
            try:
                ids = self._checked_prompt(prompt, params)
            except RequestError as error:
                if len(prompts) == 1:
                    raise
                raise RequestError(f"prompt {index}: {error}", error.param, error.code) from None
            offsets = text_starts(self.tokenizer, ids) if params.prompt_logprobs is not None else []
            groups.append([self._sequence(ids, params, choice, offsets) for choice in range(n)])
        sequences = [sequence for group in groups for sequence in group]
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down and takes no new request")
            if len(self._waiting) + count - self._admissible(sequences) > self.config.max_queue:
                why = "the most the queue holds" if count == 1 else \
                    f"{count} completions would pass the {self.config.max_queue} the queue holds; none was queued"
                raise QueueFull(f"{len(self._running)} requests are running and {len(self._waiting)} waiting "
                                f"({why}); retry later")
            self._waiting.extend(sequences)
            self._lock.notify_all()
        self.start()
        return [[sequence.stream for sequence in group] for group in groups]

    def _checked_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's ids, once it is known to fit the context and the KV budget with max_tokens."""
        ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_context:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                               "(prompt and completion): shorten it", "prompt", "context_length_exceeded")
        total = len(ids) + params.max_tokens
        if total > self.max_context:
            raise RequestError(f"max_tokens {params.max_tokens} with a prompt of {len(ids)} tokens is past the "
                               f"context of {self.max_context}: ask for at most {self.max_context - len(ids)}",
                               "max_tokens", "context_length_exceeded")
        if not self.pool.fits_ever(total):
            raise RequestError(f"{total} tokens need {self.pool.bytes_for(total) / MIB:.1f} MiB of KV cache; the "
                               f"server holds {self.config.kv_memory_mb:g} MiB: ask for fewer tokens (or start it "
                               "with a larger --kv-memory)", "max_tokens")
        return ids

    def _sequence(self, ids: list[int], params: SamplingParams, choice: int, offsets: list[int]) -> _Sequence:
        """Completion `choice` of a request: its stream and its RequestSampler (seeded); `offsets`: where each
        prompt token's text starts, when it asks for prompt log probabilities."""
        stream = RequestStream(f"cmpl-{uuid.uuid4().hex[:24]}", ids)
        if params.seed is not None:  # seed + choice; past 2**64 - 1 it wraps, as the generator reads 64 bits
            seed = params.seed + choice
            seed -= 2**64 if seed > SEED_RANGE[1] else 0
        else:  # drawn even for greedy requests, so that the engine's draws do not depend on them
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        sampler = RequestSampler(params, self.vocab, seed)
        sequence = _Sequence(stream, params, ids, Detokenizer(self.tokenizer, params.stop, ids), sampler)
        if params.logprobs is not None:
            sequence.logprobs = []
        if params.prompt_logprobs is not None:
            sequence.prompt_logprobs, sequence.prompt_offsets = [], offsets
        return sequence

    def _admissible(self, sequences: list[_Sequence]) -> int:
        """How many of these sequences would be admitted at once, in order (slots and their memory free, nobody
        ahead of them)."""
        if self._waiting:
            return 0
        slots = self.config.max_running - len(self._running)
        room = self.pool.budget - self.pool.used_bytes()
        admitted = 0
        for sequence in sequences[:max(0, slots)]:
            room -= self.pool.bytes_for(len(sequence.prompt) + sequence.params.max_tokens)
            if room < 0:
                break
            admitted += 1
        return admitted

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> Completion:
        """Run one request to its end (blocking)."""
        start = time.perf_counter()
        stream = self.submit(prompt, params)
        text, ids, times, reason = [], [], [], "stop"
        logprobs: list[TokenLogprob] | None = None
        prompt_logprobs: list[TokenLogprob] | None = None
        for event in stream:
            text.append(event.text)
            ids.extend(event.token_ids)
            times.append(event.time_s)
            reason = event.finish_reason or reason
            if event.logprobs is not None:
                logprobs = logprobs if logprobs is not None else []
                logprobs.extend(event.logprobs)
            if event.prompt_logprobs is not None:
                prompt_logprobs = list(event.prompt_logprobs)
        first = times[0] - start if times else 0.0
        return Completion("".join(text), ids, stream.prompt_tokens, reason, first, times, logprobs, prompt_logprobs)

    # the loop ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._looping is None:
                # What exists now (the model's modules and parameters, the pool's tensors, the interpreter's own
                # objects) lives as long as the engine: frozen, it is no longer scanned by the collections that
                # each step's short-lived objects trigger (they took 15-20% of a decode step); shutdown unfreezes.
                gc.freeze()
                self._runner = self._runner or ModelThread()
                self._looping = self._runner.submit(self._loop)

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting; waiting requests end now, running ones by `grace_s` seconds from now."""
        with self._lock:
            self._accepting = False
            self._deadline = time.perf_counter() + grace_s
            while self._waiting:
                self._end(self._waiting.popleft(), "shutdown")
            self._lock.notify_all()
            looping = self._looping
        if looping is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                looping.result(timeout=grace_s + 30.0)
            gc.unfreeze()  # what start froze can be collected again once it is garbage (a process of many engines)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._admit()
                while not self._running:
                    if not self._accepting:
                        return
                    self._lock.wait(timeout=1.0)
                    self._admit()
                if self._deadline is not None and time.perf_counter() > self._deadline:
                    for sequence in list(self._running):
                        self._finish(sequence, "shutdown")
                    continue
                batch = list(self._running)
            try:
                self._step(batch)
            except Exception:  # a failed step ends its requests, never the server
                log.exception("a decode step failed; its %d requests end with an error", len(batch))
                with self._lock:
                    for sequence in batch:
                        if sequence in self._running:
                            self._finish(sequence, "error")

    def _admit(self) -> None:
        """Under the lock: drop cancelled sequences, then admit waiting ones in order while they fit."""
        for sequence in [s for s in self._running if s.stream.cancelled]:
            self._finish(sequence, "cancelled")
        for sequence in [s for s in self._waiting if s.stream.cancelled]:
            self._waiting.remove(sequence)
            self._end(sequence, "cancelled")
        while self._waiting and len(self._running) < self.config.max_running:
            sequence = self._waiting[0]
            slot = self.pool.allocate(len(sequence.prompt) + sequence.params.max_tokens)
            if slot is None:
                return
            sequence.slot = slot
            self._running.append(self._waiting.popleft())

    @staticmethod
    def _last(sequence: _Sequence, reason: str, text: str = "", token_ids: tuple[int, ...] = (),
              logprobs: tuple[TokenLogprob, ...] | None = ()) -> TokenEvent:
        """A sequence's last event. A request that asked for log probabilities gets a tuple (maybe empty), else
        None."""
        return TokenEvent(text, token_ids, len(sequence.prompt), len(sequence.tokens), reason, time.perf_counter(),
                          None if sequence.logprobs is None else logprobs, sequence.take_prompt_logprobs())

    def _end(self, sequence: _Sequence, reason: str) -> None:
        """End a sequence that never ran (it holds no slot)."""
        sequence.stream.push(self._last(sequence, reason))

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        """End a running sequence with nothing more to show (called with the lock held or not: it is
        re-entrant)."""
        self._retire([(sequence, self._last(sequence, reason))])

    def _retire(self, ended: list[tuple[_Sequence, TokenEvent]]) -> None:
        """Give the slots and blocks of running sequences back (under the lock), then push their last events: a
        client that has read its last event finds the memory free."""
        with self._lock:
            for sequence, _ in ended:
                self._running.remove(sequence)
                self.pool.release(sequence.slot)
        for sequence, event in ended:
            sequence.stream.push(event)

    def _step(self, batch: list[_Sequence]) -> None:
        ids, row_seq, positions, wanted, sampling = [], [], [], [], []
        scored: list[tuple[_Sequence, int, int, int]] = []  # (sequence, its chunk's first row, first/last position)
        scored_only: list[_Sequence] = []  # prompts scored with max_tokens 0: they end after their prefill
        budget = self.config.prefill_chunk
        for sequence in batch:
            if sequence.decoding:
                position = len(sequence.prompt) + len(sequence.tokens) - 1
                ids.append(sequence.tokens[-1])
                row_seq.append(sequence.slot)
                positions.append(position)
            else:
                start = sequence.prefilled
                end = min(len(sequence.prompt), (start // self.config.prefill_chunk + 1) * self.config.prefill_chunk)
                if end - start > budget:
                    continue  # its chunk waits for the next step; chunks are never cut differently
                budget -= end - start
                if sequence.prompt_logprobs is not None:
                    scored.append((sequence, len(ids), start, end))
                ids.extend(sequence.prompt[start:end])
                row_seq.extend([sequence.slot] * (end - start))
                positions.extend(range(start, end))
                sequence.prefilled = end
                if not sequence.decoding:
                    continue
                if sequence.params.max_tokens == 0:
                    scored_only.append(sequence)
                    continue
            wanted.append(len(ids) - 1)
            sampling.append(sequence)
        # The rows that score prompt tokens come after the sampling rows: the row at position p predicts token p+1.
        scoring = [row + p - start for sequence, row, start, end in scored
                   for p in range(start, min(end, len(sequence.prompt) - 1))]
        rows = self.pool.rows(row_seq, positions)
        logits = self.decoder.forward(torch.tensor(ids), rows, torch.tensor(wanted + scoring, dtype=torch.int64))
        self._steps += 1
        for sequence, entries in self._score_prompts(scored, logits[len(wanted):]):
            sequence.prompt_logprobs.extend(entries)
        tokens, logprobs = choose_tokens(logits[:len(wanted)], [sequence.sampler for sequence in sampling])
        now = time.perf_counter()
        # Only this thread touches a running sequence (the others read stream.cancelled, which the next step acts
        # on), so the detokenizers and stop strings run outside the lock; it is taken once, for those that ended.
        ended = [(sequence, self._last(sequence, "length")) for sequence in scored_only]
        for sequence, token, logprob in zip(sampling, tokens, logprobs, strict=True):
            last = self._advance(sequence, token, now, logprob)
            if last is not None:
                ended.append((sequence, last))
        if ended:
            self._retire(ended)

    @staticmethod
    def _score_prompts(scored: list[tuple[_Sequence, int, int, int]],
                       logits: torch.Tensor) -> list[tuple[_Sequence, list[TokenLogprob]]]:
        """Each scored chunk's prompt tokens' log probabilities from its rows of `logits` (in `scored`'s order)."""
        out, first = [], 0
        for sequence, _, start, end in scored:
            targets = sequence.prompt[start + 1:min(end + 1, len(sequence.prompt))]
            rows = logits[first:first + len(targets)]
            first += len(targets)
            offsets = sequence.prompt_offsets[start + 1:start + 1 + len(targets)]
            out.append((sequence, token_logprobs(rows, targets, sequence.params.prompt_logprobs, offsets)))
        return out

    def _advance(self, sequence: _Sequence, token: int, now: float,
                 logprob: TokenLogprob | None = None) -> TokenEvent | None:
        """Take the sequence's new token and push its text; when the token ends it, its last event instead, not
        pushed (the caller gives its slot back first)."""
        sequence.tokens.append(token)
        count = len(sequence.tokens)
        detokenizer = sequence.detokenizer
        if token in self.eos and not sequence.params.ignore_eos:  # counted as generated, never shown
            return self._last(sequence, "stop", detokenizer.flush(), logprobs=self._released(sequence, final=True))
        text = detokenizer.add(token)
        if logprob is not None:
            sequence.logprobs.append(dataclasses.replace(logprob, offset=detokenizer.starts[-1]))
        if detokenizer.stopped:
            return self._last(sequence, "stop", text, (token,), self._released(sequence))
        if count >= sequence.params.max_tokens:
            return self._last(sequence, "length", text + detokenizer.flush(), (token,),
                              self._released(sequence, True))
        # (the common case: requests without log probabilities skip even the call)
        sequence.stream.push(TokenEvent(text, (token,), len(sequence.prompt), count, None, now,
                                        None if sequence.logprobs is None else self._released(sequence),
                                        sequence.take_prompt_logprobs()))
        return None

    @staticmethod
    def _released(sequence: _Sequence, final: bool = False) -> tuple[TokenLogprob, ...] | None:
        """The log probabilities of the tokens whose text has now been released and whose log probabilities have
        not gone out yet (all the rest when the request ends without a stop string); None when not asked for."""
        if sequence.logprobs is None:
            return None
        end = len(sequence.logprobs) if final else sequence.detokenizer.released_tokens()
        start, sequence.logprobs_sent = sequence.logprobs_sent, max(end, sequence.logprobs_sent)
        return tuple(sequence.logprobs[start:end])

    # state -------------------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(len(self._running), len(self._waiting), self.config.max_running,
                               self.config.max_queue, self.pool.used_bytes(), self.pool.budget, self.pool.kind,
                               self.pool.block_size, self.pool.blocks_used, self.pool.num_blocks, self._steps,
                               self._accepting)

    def kv_capacity(self, tokens: int) -> int:
        """Sequences of `tokens` tokens the KV budget holds at once."""
        return self.pool.capacity(tokens)


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(found if isinstance(found, list | tuple) else [found] if found is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
