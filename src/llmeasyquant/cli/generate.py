"""`llmeasyquant generate MODEL --prompt TEXT`: the continuation on stdout as it is decoded, the usage on stderr."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from llmeasyquant.cli.options import (
    DEFAULT_MODEL,
    add_engine_options,
    add_sampling_options,
    load_engine,
    sampling_params,
)
from llmeasyquant.errors import LLMEasyQuantError

if TYPE_CHECKING:
    from llmeasyquant.runtime.engine import Engine, RequestStream
    from llmeasyquant.runtime.requests import SamplingParams, TokenEvent


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="continue a prompt, the text streamed to the terminal as it is decoded "
                       "(through the serving engine: its KV cache options apply)")
    g.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="checkpoint folder or model spec")
    g.add_argument("--prompt", required=True, help="the text to continue")
    add_sampling_options(g, max_new_tokens=128)
    add_engine_options(g)


def stream_to(out: TextIO, stream: RequestStream, start_s: float) -> tuple[str, TokenEvent, float | None]:
    """Write each event's text as it comes (flushed, so a terminal shows it at once), then end the line; the whole
    text, the last event, and the seconds from `start_s` to the first generated token (None when there was none).

    Ctrl-C cancels the request before it propagates, so the engine frees its sequence."""
    last, first_s, parts = None, None, []
    try:
        for event in stream:
            if first_s is None and event.completion_tokens > 0:
                first_s = (event.time_s or time.perf_counter()) - start_s
            if event.text:
                parts.append(event.text)
                out.write(event.text)
                out.flush()
            last = event
    except KeyboardInterrupt:
        stream.cancel()
        raise
    out.write("\n")
    out.flush()
    assert last is not None  # a stream always ends with an event that holds the finish reason
    return "".join(parts), last, first_s


def usage_line(last: TokenEvent, start_s: float, first_s: float | None) -> str:
    """`12 prompt + 40 generated tokens, 1.30 s (31.2 tokens/s after the first at 0.08 s), finish: length`."""
    total = time.perf_counter() - start_s
    speed = ""
    if first_s is not None and last.completion_tokens > 1 and total > first_s:
        speed = (f" ({(last.completion_tokens - 1) / (total - first_s):.1f} tokens/s after the first at "
                 f"{first_s:.2f} s)")
    return (f"{last.prompt_tokens} prompt + {last.completion_tokens} generated tokens, {total:.2f} s{speed}, "
            f"finish: {last.finish_reason}")


def run_request(engine: Engine, prompt: str | list[int], params: SamplingParams, out: TextIO) -> str:
    """Submit, stream the text to `out`, and write the usage line to stderr; the text."""
    start = time.perf_counter()
    text, last, first_s = stream_to(out, engine.submit(prompt, params), start)
    print(usage_line(last, start, first_s), file=sys.stderr, flush=True)
    if last.finish_reason == "error":
        raise LLMEasyQuantError("the engine failed while decoding (its log above says why); run with --debug for "
                                "the details")
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)
    engine = load_engine(args)
    try:
        run_request(engine, args.prompt, params, sys.stdout)
    finally:
        engine.shutdown(grace_s=0.0)
