"""`llmeasyquant compare`: several schemes or methods against the unquantized model, in one table and report."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from llmeasyquant.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_SCHEMES,
    METHOD_HELP,
    add_calibration_options,
    add_eval_options,
)
from llmeasyquant.cli.resolve import build_recipe, build_simquant, method_options
from llmeasyquant.errors import LLMEasyQuantError

log = logging.getLogger("llmeasyquant")


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """The `compare` subcommand's options."""
    c = sub.add_parser("compare", help="quantize with several schemes or methods and print one comparison table")
    c.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    c.add_argument("--schemes", help=f"comma-separated schemes (default {DEFAULT_SCHEMES}); with --methods at most "
                   "one, applied to every method (default: each method's own)")
    c.add_argument("--method", default="rtn", help=METHOD_HELP)
    c.add_argument("--methods", help="comma-separated methods compared side by side, each under its own scheme, "
                   "e.g. rtn,smoothquant,awq,gptq,zeroquant (replaces --method)")
    c.add_argument("--details", action="store_true", help="also measure speed, latency breakdown, block errors, "
                   "weight distributions and context-length scaling for the report's figures")
    c.add_argument("--report", type=Path, help="write a self-contained HTML report with the figures (implies "
                   "--details)")
    c.add_argument("--force", action="store_true", help="replace --report if it exists")
    c.add_argument("--keep-fp32", action="store_true", help="store unquantized tensors in fp32")
    add_calibration_options(c)
    c.add_argument("--workdir", type=Path, help="keep the checkpoints here (default: a temporary folder)")
    add_eval_options(c, 40)


def _compared_rows(args: argparse.Namespace) -> tuple[list, list | None]:
    """(schemes, methods or None) from --schemes / --methods, checked before the model is loaded."""
    from llmeasyquant import parse_scheme
    from llmeasyquant.methods import recipe_by_name

    schemes = [parse_scheme(s) for s in (args.schemes or ("" if args.methods else DEFAULT_SCHEMES)).split(",")
               if s.strip()]
    if not args.methods:
        if not schemes:
            raise LLMEasyQuantError("--schemes is empty; name at least one scheme, e.g. w8a16")
        return schemes, None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise LLMEasyQuantError("--methods is empty; name at least one, e.g. rtn,gptq")
    if len(schemes) > 1:
        raise LLMEasyQuantError("with --methods give at most one scheme in --schemes (or none: each method's own)")
    recipes = [recipe_by_name(m, strict=False, **method_options(args)) for m in methods]
    needing = [m for m, recipe in zip(methods, recipes, strict=True) if any(r.needs_calibration for r in recipe)]
    if needing and not args.calib:
        raise LLMEasyQuantError(f"{', '.join(needing)} need calibration text: pass --calib wikitext2 (shipped "
                                "WikiText-2 validation), --calib PATH or --calib self")
    return schemes, methods


def cmd_compare(args: argparse.Namespace) -> None:
    from llmeasyquant import CompareSpec, compare
    from llmeasyquant.infra.files import check_output
    from llmeasyquant.record import write_records
    from llmeasyquant.report.tables import COMPARE_COLUMNS, format_table

    schemes, methods = _compared_rows(args)
    recipe = build_recipe(args) if methods is None else args.method  # an unknown method fails now, not after loading
    if args.report is not None:
        check_output(args.report, args.force)
    spec = CompareSpec(args.model, schemes, recipe, methods=methods, method_options=method_options(args),
                       kv=build_simquant(args), text=args.text, seqlen=args.seqlen, max_windows=args.max_windows,
                       calib=args.calib, calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen,
                       keep_fp32=args.keep_fp32, workdir=args.workdir, seed=args.seed,
                       details=args.details or args.report is not None)
    records = compare(spec, progress=not args.quiet, command=args.command_line)
    p = records[0].protocol
    kv_cache = records[-1].metric("kv_cache")
    kv = f", KV cache {kv_cache}" if kv_cache is not None else ""
    what = f"methods {', '.join(methods)}" if methods else f"method {args.method}"
    print(f"\n{args.model}, {what}{kv}: {p['windows']} windows of {p['seqlen']} tokens from "
          f"{p['text_source']} (sha256 {p['text_sha256'][:12]}…), no BOS, {p['threads']} threads\n")
    columns = ((("method", "method", ""),) if methods else ()) + COMPARE_COLUMNS
    print(format_table([r.metrics for r in records], columns))
    if args.json:
        write_records(args.json, records)
    if args.report is not None:
        from llmeasyquant.report.html import write_report_html

        print(f"wrote {write_report_html(records, args.report, force=args.force)}")
