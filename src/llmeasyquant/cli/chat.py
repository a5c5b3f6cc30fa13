"""`llmeasyquant chat MODEL`: an interactive chat in the terminal through the tokenizer's chat template.

One message per line from stdin, until end of input (Ctrl-D) or `/exit`; each reply is streamed to stdout as it
is decoded, its usage line goes to stderr. The whole conversation is the prompt of every turn; when it outgrows the
context, the oldest exchanges are dropped (the system message stays).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from llmeasyquant.cli.generate import run_request
from llmeasyquant.cli.options import (
    DEFAULT_MODEL,
    add_engine_options,
    add_sampling_options,
    load_engine,
    sampling_params,
)
from llmeasyquant.runtime.requests import RequestError

if TYPE_CHECKING:
    from llmeasyquant.runtime.engine import Engine

log = logging.getLogger("llmeasyquant")

EXIT_COMMAND = "/exit"


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("chat", help="an interactive chat through the tokenizer's chat template: one message per "
                       f"line, {EXIT_COMMAND} or end of input (Ctrl-D) to end")
    c.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="checkpoint folder or model spec")
    c.add_argument("--system", help="a system message opening the conversation")
    add_sampling_options(c, max_new_tokens=512)
    add_engine_options(c)


def fit_conversation(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of the conversation, dropping its oldest exchanges (never the system message or the last
    message) while it leaves no room in the context for a reply."""
    ids = engine.chat_prompt(messages)
    first = 1 if messages[0]["role"] == "system" else 0
    while len(ids) >= engine.max_context and len(messages) - first > 1:
        # An exchange is a user message and the reply to it: drop both, so the roles still alternate.
        dropped = 2 if len(messages) - first > 2 else 1
        del messages[first:first + dropped]
        log.warning("the conversation outgrew the context of %d tokens: its oldest exchange is dropped",
                    engine.max_context)
        ids = engine.chat_prompt(messages)
    return ids


def cmd_chat(args: argparse.Namespace) -> None:
    sampling_params(args)  # options out of range fail before the model loads
    engine = load_engine(args)
    try:
        system = [{"role": "system", "content": args.system}] if args.system else []
        engine.chat_prompt([*system, {"role": "user", "content": "hello"}])  # no chat template: fail now
        _converse(engine, args, system)
    finally:
        engine.shutdown(grace_s=0.0)


def _converse(engine: Engine, args: argparse.Namespace, messages: list[dict[str, str]]) -> None:
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {engine.name}; {EXIT_COMMAND} or Ctrl-D ends it", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == EXIT_COMMAND:
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\r\n")})
        try:
            ids = fit_conversation(engine, messages)
            params = sampling_params(args, max_tokens=max(1, min(args.max_new_tokens, engine.max_context - len(ids))))
            reply = run_request(engine, ids, params, sys.stdout)
        except RequestError as exc:  # this message cannot be answered (too long, say); the chat goes on
            messages.pop()
            print(f"llmeasyquant: {exc}", file=sys.stderr, flush=True)
            continue
        except KeyboardInterrupt:  # Ctrl-C ends the reply (the request is cancelled), not the chat
            messages.pop()
            print("\n(reply interrupted)", file=sys.stderr, flush=True)
            continue
        messages.append({"role": "assistant", "content": reply})
