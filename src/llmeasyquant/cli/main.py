"""llmeasyquant quantize | eval | compare | search | export | bench | report | generate | chat | serve: a thin layer
over the Python API."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

import torch

from llmeasyquant.cli.bench import add_bench_parser, cmd_bench
from llmeasyquant.cli.chat import add_chat_parser, cmd_chat
from llmeasyquant.cli.compare import add_compare_parser, cmd_compare
from llmeasyquant.cli.evaluate import add_eval_parser, cmd_eval
from llmeasyquant.cli.export import add_export_parser, cmd_export
from llmeasyquant.cli.generate import add_generate_parser, cmd_generate
from llmeasyquant.cli.quantize import add_quantize_parser, cmd_quantize
from llmeasyquant.cli.report import add_report_parser, cmd_report
from llmeasyquant.cli.search import add_search_parser, cmd_search
from llmeasyquant.cli.serve import add_serve_parser, cmd_serve
from llmeasyquant.errors import LLMEasyQuantError
from llmeasyquant.record import portable_argument

log = logging.getLogger("llmeasyquant")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmeasyquant", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="full tracebacks and debug logging")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--distributed", action="store_true", help="quantize or eval on torch.distributed (implied "
                        "under torchrun): calibration data, layer solves and evaluation windows shared out")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="torch.distributed backend (default: nccl when every rank has a GPU, else gloo)")
    parser.add_argument("--dist-timeout", type=float, default=300.0,
                        help="seconds a rank waits for its peers before the run fails (default 300)")
    sub = parser.add_subparsers(dest="command", required=True)

    add_quantize_parser(sub)
    add_eval_parser(sub)
    add_compare_parser(sub)
    add_search_parser(sub)
    add_export_parser(sub)
    add_bench_parser(sub)
    add_report_parser(sub)
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    return parser


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "compare": cmd_compare, "search": cmd_search,
            "export": cmd_export, "bench": cmd_bench, "report": cmd_report, "generate": cmd_generate,
            "chat": cmd_chat, "serve": cmd_serve}


DISTRIBUTED_COMMANDS = ("quantize", "eval")



@contextlib.contextmanager
def _distributed_run(args: argparse.Namespace):
    """Join the process group when asked (or under torchrun); ranks other than 0 print nothing and write nothing."""
    from llmeasyquant.infra import distributed

    if not (args.distributed or distributed.launched_by_torchrun()):
        yield
        return
    if args.command not in DISTRIBUTED_COMMANDS:
        raise LLMEasyQuantError(f"{args.command} does not run distributed; run it in one process (distributed: "
                                f"{', '.join(DISTRIBUTED_COMMANDS)})")
    distributed.init(args.backend, args.dist_timeout)
    try:
        if distributed.is_writer():
            yield
        else:
            args.quiet, args.json = True, None
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                yield
    finally:
        distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The command line the records name, passed to each command (even when main() is called in-process).
    args.command_line = " ".join(["llmeasyquant", *map(portable_argument, sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    import transformers

    if not args.debug:
        transformers.logging.set_verbosity_error()
    if args.quiet:
        transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        with _distributed_run(args):
            COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("llmeasyquant: interrupted", file=sys.stderr)
        return 130
    except (LLMEasyQuantError, OSError, ValueError) as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"llmeasyquant: error: {message}", file=sys.stderr)
        return 2
    log.debug("%s took %.1f s", args.command, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
