"""`llmeasyquant serve MODEL`: the OpenAI-compatible HTTP server (serving/) over the serving engine."""

from __future__ import annotations

import argparse
import os

from llmeasyquant.cli.options import DEFAULT_MODEL, add_engine_options, load_engine, served_model_name

API_KEY_ENV = "LLMEASYQUANT_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                       "/v1/models, /health, /metrics) with continuous batching; needs the 'serve' extra")
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="checkpoint folder or model spec")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 listens on every interface, use it with --api-key)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--served-model-name", help="the model's name in the API (default: the checkpoint folder's name "
                   "or the model spec); requests must name it")
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help="require 'Authorization: Bearer KEY' on "
                   f"every endpoint but /health (default: ${API_KEY_ENV}; none: no key needed)")
    s.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS", help="on SIGTERM, the time "
                   "running requests get to finish before they end with finish_reason 'shutdown' (default 30)")
    s.add_argument("--seed", type=int, help="seed of the engine's generator, which seeds requests that send none "
                   "(default 0)")
    add_engine_options(s)


def cmd_serve(args: argparse.Namespace) -> None:
    from llmeasyquant.errors import ConfigError
    from llmeasyquant.serving.run import require_serve_extra

    require_serve_extra()  # before the model loads: a missing extra should cost no wait
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must lie in 0..65535, got {args.port}")
    if args.shutdown_grace < 0:
        raise ConfigError(f"--shutdown-grace must be 0 or more seconds, got {args.shutdown_grace}")
    from llmeasyquant.serving.run import serve

    name = args.served_model_name or served_model_name(args.model)
    engine = load_engine(args, name)
    try:
        serve(engine, args.host, args.port, name, args.api_key, args.shutdown_grace)
    finally:
        engine.shutdown(grace_s=0.0)  # a no-op after a graceful stop; after a failed start, the decode thread ends
