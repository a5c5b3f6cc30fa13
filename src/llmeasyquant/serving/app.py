"""The FastAPI app: the OpenAI endpoints over one Engine, vLLM's tokenizer endpoints, /health and /metrics.

Every request is parsed and checked before it reaches the engine, so a bad one is answered with an OpenAI error
body (serving/errors.py) and never touches the decode loop. A stream is read on the event loop (the engine pushes
its events there; no thread per request); when its client goes away the request is cancelled, and the engine gives
its sequence and KV blocks back at its next step.

A request for n choices is n engine sequences of one prompt (Engine.submit_many: all queued, or a 429 and none);
a completions request of several prompts is n sequences of each (Engine.submit_prompts), choice p * n + j being
prompt p's j-th. Their events are read together, in the order they come: a stream interleaves chunks of every
choice, each tagged with its index. When the client goes away, or one choice fails, every choice still running is
cancelled. With `echo`, each choice's first chunk (or its whole text) starts with its prompt's text, and its log
probabilities with the prompt's, as the engine scored them.

Tokenizing, rendering a chat template, queueing and decoding token ids grow with the prompt: they run in worker
threads, so that one long prompt never holds up the event loop and the streams of every other client with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmeasyquant.runtime.requests import RequestError, TokenEvent, TokenLogprob
from llmeasyquant.serving import protocol
from llmeasyquant.serving.errors import ApiError, api_error, error_body
from llmeasyquant.serving.metrics import RequestTracker, ServerMetrics
from llmeasyquant.version import __version__

if TYPE_CHECKING:
    from llmeasyquant.runtime.engine import Engine, RequestStream
    from llmeasyquant.runtime.token_pieces import TokenPieces

log = logging.getLogger(__name__)

UNCOUNTED_PATHS = ("/health", "/metrics")  # scraped often: counting them would drown the API's own requests
# Without max_tokens a chat request gets the rest of the context, up to this: the engine reserves KV memory for
# max_tokens when it admits a request, so an open-ended default would hold a whole context's cache per request.
CHAT_DEFAULT_MAX_TOKENS = 512
SSE_PING_S = 15.0
MAX_BODY_BYTES = 8 * 2**20  # far past any prompt a 4,096-token context holds, as text or as token ids
SHUTDOWN_MARGIN_S = 5.0  # past the engine's grace: time for the last events to reach the clients

_T = TypeVar("_T")
_Groups = list[list["RequestStream"]]  # per prompt, the streams of its choices


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    api_key: str | None
    shutdown_grace_s: float
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=protocol.now)
    _stopping: asyncio.Future | None = None

    def begin_shutdown(self) -> asyncio.Future:
        """Stop the engine (once) in a thread: it refuses new requests at once, ends the waiting ones, and gives the
        running ones `shutdown_grace_s` seconds before ending them with finish_reason "shutdown". Awaitable."""
        if self._stopping is None:
            log.info("shutting down: no new requests; running ones get %.0f s to finish", self.shutdown_grace_s)
            self._stopping = asyncio.ensure_future(asyncio.to_thread(self.engine.shutdown, self.shutdown_grace_s))
        return self._stopping


def build_app(engine: Engine, served_model_name: str | None = None, api_key: str | None = None,
              shutdown_grace_s: float = 30.0) -> FastAPI:
    """The app serving `engine` under `served_model_name` (default: the engine's name). With `api_key`, every
    endpoint but /health needs `Authorization: Bearer <api_key>`."""
    state = ServerState(engine, served_model_name or engine.name, api_key or None, shutdown_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await state.begin_shutdown()

    app = FastAPI(title="llmeasyquant", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    _add_error_handlers(app, state)
    auth = [Depends(_authorizer(state))]

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = engine.stats()
        body = {"status": "ok" if stats.accepting else "shutting_down", "model": state.model_name,
                "running": stats.running, "waiting": stats.waiting, "kv_blocks_used": stats.blocks_used,
                "kv_blocks_total": stats.blocks_total}
        return JSONResponse(body, status_code=200 if stats.accepting else 503)

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        body, content_type = state.metrics.render(engine)
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models", dependencies=auth)
    @_guarded
    async def models() -> JSONResponse:
        state.metrics.count("ok")
        return JSONResponse({"object": "list", "data": [protocol.model_card(state.model_name, state.created)]})

    @app.get("/v1/models/{model:path}", dependencies=auth)
    @_guarded
    async def model(model: str) -> JSONResponse:
        _check_model(state, model)
        state.metrics.count("ok")
        return JSONResponse(protocol.model_card(state.model_name, state.created))

    # The tokenizer, as vLLM serves it: clients that send token ids (evaluation harnesses) need no copy of their own.
    @app.post("/tokenize", dependencies=auth)
    @_guarded
    async def tokenize(request: Request) -> JSONResponse:
        req = await _parse(request, protocol.TokenizeRequest, engine.vocab)
        _check_model(state, req.model)
        tokens = await asyncio.to_thread(engine.tokenize, req.prompt, req.add_special_tokens)
        state.metrics.count("ok")
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_context})

    @app.post("/detokenize", dependencies=auth)
    @_guarded
    async def detokenize(request: Request) -> JSONResponse:
        req = await _parse(request, protocol.DetokenizeRequest, engine.vocab)
        _check_model(state, req.model)
        state.metrics.count("ok")
        return JSONResponse({"prompt": await asyncio.to_thread(engine.decode, req.tokens)})

    @app.get("/tokenizer_info", dependencies=auth)
    @_guarded
    async def tokenizer_info() -> JSONResponse:
        tokenizer = engine.tokenizer
        state.metrics.count("ok")
        return JSONResponse({"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                             "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                             "chat_template": getattr(tokenizer, "chat_template", None),
                             "model_max_length": engine.max_context})

    @app.post("/v1/completions", dependencies=auth)
    @_guarded
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(request, protocol.CompletionRequest, engine.vocab)
        _check_model(state, req.model)
        params = req.sampling(req.max_tokens, protocol.COMPLETION_DEFAULT_MAX_TOKENS)

        def submit() -> tuple[_Groups, list[str] | None]:
            groups = engine.submit_prompts(req.prompts, params, req.choices)
            # Echoed: the prompt as sent; token ids as they decode.
            return groups, [p if isinstance(p, str) else engine.decode(p) for p in req.prompts] if req.echo else None

        groups, texts = await _queued(submit)
        streams = [stream for group in groups for stream in group]
        echo = None
        if texts is not None:
            echo = [_Echo(text, group[0].prompt_ids[0]) for text, group in zip(texts, groups, strict=True)
                    for _ in group]
        fmt = _Format("text_completion", streams[0].id, state.model_name, engine.token_pieces, echo)
        prompt_tokens = sum(group[0].prompt_tokens for group in groups)
        return await _answer(request, state, streams, arrival, fmt, req, prompt_tokens)

    @app.post("/v1/chat/completions", dependencies=auth)
    @_guarded
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(request, protocol.ChatRequest, engine.vocab)
        _check_model(state, req.model)

        def submit() -> tuple[_Groups, None]:
            ids = engine.chat_prompt([m.as_dict() for m in req.messages])
            default = max(1, min(CHAT_DEFAULT_MAX_TOKENS, engine.max_context - len(ids)))
            return [engine.submit_many(ids, req.sampling(req.max_new_tokens(), default), req.choices)], None

        [streams], _ = await _queued(submit)
        chat_id = "chatcmpl-" + streams[0].id.removeprefix("cmpl-")
        fmt = _Format("chat.completion", chat_id, state.model_name, engine.token_pieces)
        return await _answer(request, state, streams, arrival, fmt, req, streams[0].prompt_tokens)

    return app


# requests ----------------------------------------------------------------------------------------------------------


def _guarded(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Turn an exception nobody expected into a logged 500 with an OpenAI body: no request can take the server
    down, and the error handlers answer it like any other error."""

    @functools.wraps(handler)
    async def run(*args: Any, **kwargs: Any) -> Response:
        try:
            return await handler(*args, **kwargs)
        except (ApiError, RequestError, ValidationError, json.JSONDecodeError):
            raise
        except Exception as exc:
            log.exception("request failed")
            raise ApiError(500, f"internal error ({type(exc).__name__}); the server logged it", "server_error",
                           code="internal_error") from exc

    return run


async def _queued(submit: Callable[[], tuple[_Groups, _T]]) -> tuple[_Groups, _T]:
    """What `submit` returns (the streams it queued, and more), run in a worker thread: it tokenizes the prompts
    (and renders the chat template), which takes time that grows with them. Its errors are raised here as if it
    had run on the event loop. Should the handler be cancelled meanwhile, the queued requests are cancelled as soon
    as they exist: nobody would read them, and they would hold their slots and KV memory to their end."""
    task = asyncio.ensure_future(asyncio.to_thread(submit))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_cancel_queued)
        raise


def _cancel_queued(task: asyncio.Future) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    groups, _ = task.result()
    for stream in (stream for group in groups for stream in group):
        stream.cancel()


async def _parse(request: Request, model: type[protocol.BaseModel], vocab_size: int) -> Any:
    raw = await _read_body(request)
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text: send a JSON object", code="invalid_json") from None
    # json.JSONDecodeError and ValidationError: the error handlers answer
    return model.model_validate(data, context={protocol.VOCAB_SIZE: vocab_size})


async def _read_body(request: Request) -> bytes:
    """The body, refused once it passes MAX_BODY_BYTES: a huge upload must not fill the server's memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        parts.append(part)
    return b"".join(parts)


def _too_large() -> ApiError:
    return ApiError(413, f"the body is larger than {MAX_BODY_BYTES // 2**20} MiB: no prompt that fits a context is "
                    "that long; shorten it", code="request_too_large")


def _check_model(state: ServerState, name: str | None) -> None:
    """A request that names a model must name the served one (one that names none is for it)."""
    if name is not None and name != state.model_name:
        raise ApiError(404, f"the model '{name}' does not exist: this server serves '{state.model_name}' (see "
                       "GET /v1/models)", param="model", code="model_not_found")


def _authorizer(state: ServerState) -> Callable[[Request], Awaitable[None]]:
    async def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the key "
                           "the server was started with (--api-key or LLMEASYQUANT_API_KEY)",
                           code="invalid_api_key")

    return authorize


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def answer(request: Request, exc: Exception) -> JSONResponse:
        error = api_error(exc)
        if error.status >= 500 and not isinstance(exc, ApiError):
            log.error("request failed", exc_info=exc)
        if request.url.path not in UNCOUNTED_PATHS:
            state.metrics.count("error_5xx" if error.status >= 500 else "error_4xx")
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = (f"no endpoint {request.method} {request.url.path}: the API has POST /v1/completions, "
                       "POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, "
                       "GET /tokenizer_info, GET /health and GET /metrics")
            error = ApiError(404, message, code="not_found")
        elif exc.status_code == 405:
            error = ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                             code="method_not_allowed")
        else:
            error = ApiError(exc.status_code, str(exc.detail))
        return answer(request, error)

    async def handled(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, exc)

    for kind in (ApiError, RequestError, ValidationError, json.JSONDecodeError, Exception):
        app.add_exception_handler(kind, handled)
    app.add_exception_handler(StarletteHTTPException, http_error)


# answers -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Echo:
    """An echoed prompt: its text and its first token (the one no log probability is given for)."""

    text: str
    first_token: int


@dataclass(frozen=True)
class _Format:
    """The OpenAI bodies of one request: a text completion or a chat completion."""

    object: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    pieces: TokenPieces  # names the tokens of log probabilities
    echo: list[_Echo] | None = None  # per choice, when the request asked for echo
    created: int = field(default_factory=protocol.now)

    @property
    def chat(self) -> bool:
        return self.object == "chat.completion"

    def logprobs(self, entries: Sequence[TokenLogprob] | None, index: int = 0,
                 prompt: Sequence[TokenLogprob] | None = None) -> dict[str, Any] | None:
        """The log probabilities of some of choice `index`'s tokens; with `prompt` (its first chunk, echoed), the
        prompt's first."""
        if entries is None:
            return None
        if self.chat:
            return protocol.chat_logprobs(entries, self.pieces)
        if self.echo is None:
            return protocol.completion_logprobs(entries, self.pieces)
        echo = self.echo[index]
        completion = protocol.completion_logprobs(entries, self.pieces, len(echo.text))
        if prompt is None:
            return completion
        return protocol.joined_logprobs([protocol.completion_logprobs(prompt, self.pieces, 0, echo.first_token),
                                         completion])

    def text(self, text: str, index: int, first: bool) -> str:
        """Choice `index`'s text of a chunk (or the whole), its prompt before it when echoed and `first`."""
        return self.echo[index].text + text if self.echo is not None and first else text

    def body(self, choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            made = [protocol.chat_choice(i, c.text, c.finish_reason, self.logprobs(c.logprobs))
                    for i, c in enumerate(choices)]
            return protocol.chat_body(self.id, self.created, self.model, made, usage)
        made = [protocol.completion_choice(i, self.text(c.text, i, True), c.finish_reason,
                                           self.logprobs(c.logprobs, i, c.prompt_logprobs))
                for i, c in enumerate(choices)]
        return protocol.completion_body(self.id, self.created, self.model, made, usage)

    def opening(self, index: int = 0) -> list[dict[str, Any]]:
        # OpenAI's first chat chunk of each choice names the role; completions have no such chunk.
        return [protocol.chat_chunk(self.id, self.created, self.model, {"role": "assistant", "content": ""},
                                    None, index)] if self.chat else []

    def delta(self, text: str, finish_reason: str | None = None, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            return protocol.chat_chunk(self.id, self.created, self.model, {"content": text} if text else {},
                                       finish_reason, index, logprobs)
        return protocol.completion_chunk(self.id, self.created, self.model, text, finish_reason, index, logprobs)

    def event_delta(self, event: TokenEvent, index: int, first: bool) -> dict[str, Any] | None:
        """The chunk of one engine event of choice `index` (`first`: its first), or None when it carries nothing."""
        text = self.text(event.text, index, first)
        prompt = event.prompt_logprobs if first else None
        if not (text or event.logprobs or (prompt and event.logprobs is not None)):
            return None
        return self.delta(text, None, index, self.logprobs(event.logprobs, index, prompt))

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return protocol.usage_chunk(kind, self.id, self.created, self.model, usage)


@dataclass
class _Choice:
    """One choice of a whole (non-stream) answer, as its events add up."""

    text: str = ""
    finish_reason: str = "stop"
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        if event.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason = event.finish_reason or self.finish_reason


def _decode_failed() -> ApiError:
    return ApiError(500, "the engine failed while decoding this request; the server logged why", "server_error",
                    code="decode_failed")


async def _answer(request: Request, state: ServerState, streams: list[RequestStream], arrival: float,
                  fmt: _Format, req: protocol.CompletionRequest | protocol.ChatRequest,
                  prompt_tokens: int) -> Response:
    """`prompt_tokens`: each prompt's counted once, however many choices it has (as OpenAI's usage)."""
    state.metrics.prompt_tokens.inc(prompt_tokens)
    tracker = RequestTracker(state.metrics, arrival, len(streams))
    if req.streaming:
        events = _sse_events(streams, tracker, fmt, req.include_usage, prompt_tokens)
        # The background task also runs when the client left before the first event (the generator never
        # started, so its own cleanup never ran).
        return EventSourceResponse(events, sep="\n", ping=SSE_PING_S,
                                   shutdown_grace_period=state.shutdown_grace_s + SHUTDOWN_MARGIN_S,
                                   background=BackgroundTask(_abandon, streams, tracker))
    try:
        choices = await _collect(request, streams, tracker)
    finally:
        _abandon(streams, tracker)
    if any(c.finish_reason == "error" for c in choices):  # answered here, not raised: the tracker counted it
        error = _decode_failed()
        return JSONResponse(error.body(), status_code=error.status)
    usage = protocol.usage(prompt_tokens, tracker.completion_tokens)
    return JSONResponse(fmt.body(choices, usage))


def _abandon(streams: list[RequestStream], tracker: RequestTracker) -> None:
    """A request whose reader has gone: cancel its choices that still run, and count its outcome (once)."""
    for index, stream in enumerate(streams):
        if tracker.finish_reasons[index] is None:
            log.info("%s: its client went away (or another choice failed) before it ended; cancelling it",
                     stream.id)
            stream.cancel()
    tracker.outcome()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of every stream tagged with its index, in the order they arrive, until each stream has ended.
    Close it (aclose) to stop reading: the readers of the streams stop with it."""
    if len(streams) == 1:  # a single choice is read directly, with no task in between
        async for event in streams[0]:
            yield 0, event
        return
    arrived: asyncio.Queue[tuple[int, TokenEvent | BaseException]] = asyncio.Queue()

    async def read(index: int, stream: RequestStream) -> None:
        try:
            async for event in stream:
                arrived.put_nowait((index, event))
                # A stream's events may be queued already (a reader that starts late): taking one at a time, the
                # readers take turns, so no choice's backlog goes out whole before the others' first chunks.
                await asyncio.sleep(0)
        except Exception as exc:  # a reader that fails must not leave the merge waiting forever
            arrived.put_nowait((index, exc))

    readers = [asyncio.ensure_future(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, event = await arrived.get()
            if isinstance(event, BaseException):
                raise event
            running -= event.finish_reason is not None
            yield index, event
    finally:
        for reader in readers:
            reader.cancel()


async def _collect(request: Request, streams: list[RequestStream], tracker: RequestTracker) -> list[_Choice]:
    """Read every choice to its end; a client that disconnects first cancels them, and a choice that fails ends
    the reading (the others are cancelled by the caller's _abandon)."""
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, streams))
    choices = [_Choice() for _ in streams]
    try:
        async with contextlib.aclosing(_merged(streams)) as events:
            async for index, event in events:
                tracker.see(event, index)
                choices[index].add(event)
                if event.finish_reason == "error":
                    break
    finally:
        watcher.cancel()
    return choices


async def _cancel_on_disconnect(request: Request, streams: list[RequestStream]) -> None:
    # The body has been read: the next message the server gives is the disconnect (or nothing, until we answer).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("%s: the client disconnected; cancelling", streams[0].id)
            for stream in streams:
                stream.cancel()
            return


def _data(chunk: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))}


async def _sse_events(streams: list[RequestStream], tracker: RequestTracker, fmt: _Format,
                      include_usage: bool, prompt_tokens: int) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of a request: chunks as the engine decodes, each tagged with its choice's index, the
    finish reason on each choice's last one, the usage after them when asked for, then [DONE]. Cancelled (client
    gone), closed early or a choice failed: the choices still running are cancelled."""
    try:
        for index in range(len(streams)):
            for chunk in fmt.opening(index):
                yield _data(chunk)
        started = [False] * len(streams)
        async with contextlib.aclosing(_merged(streams)) as events:
            async for index, event in events:
                tracker.see(event, index)
                if event.finish_reason == "error":
                    yield _data(_decode_failed().body())
                    break
                chunk = fmt.event_delta(event, index, not started[index])
                started[index] = True
                if chunk is not None:
                    yield _data(chunk)
                if event.finish_reason is not None:
                    yield _data(fmt.delta("", event.finish_reason, index))
            else:
                if include_usage:
                    yield _data(fmt.usage(protocol.usage(prompt_tokens, tracker.completion_tokens)))
        yield {"data": "[DONE]"}
    except Exception:  # the status line is sent: the client learns of the failure from an error event
        log.exception("%s: the stream failed", streams[0].id)
        tracker.outcome("error_5xx")
        yield _data(error_body("internal error while streaming; the server logged it", "server_error",
                               code="internal_error"))
        yield {"data": "[DONE]"}
    finally:
        _abandon(streams, tracker)
