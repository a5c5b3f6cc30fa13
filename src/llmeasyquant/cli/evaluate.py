"""`llmeasyquant eval`: perplexity, and KL / top-1 against the unquantized model, of a checkpoint or model."""

from __future__ import annotations

import argparse
import logging

import torch

from llmeasyquant.cli.options import DEFAULT_MODEL, add_calib_text_options, add_eval_options, add_kv_options
from llmeasyquant.cli.resolve import build_calibration, build_simquant
from llmeasyquant.errors import LLMEasyQuantError

log = logging.getLogger("llmeasyquant")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """The `eval` subcommand's options."""
    e = sub.add_parser("eval", help="perplexity (and KL / top-1 against the unquantized model) of a checkpoint")
    e.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="checkpoint folder or model spec")
    add_eval_options(e, None)
    e.add_argument("--reference", help="unquantized model for KL / top-1 (default: the checkpoint's source model)")
    e.add_argument("--no-reference", action="store_true", help="perplexity only")
    add_kv_options(e)
    add_calib_text_options(e)
    e.add_argument("--no-kv-cache", action="store_true",
                   help="evaluate a checkpoint with an unquantized KV cache even when it carries a quantized one")


def cmd_eval(args: argparse.Namespace) -> None:
    from llmeasyquant import evaluate, load, load_model
    from llmeasyquant.export.checkpoint import is_checkpoint
    from llmeasyquant.record import write_records

    reference = None
    if is_checkpoint(args.model):
        model, tokenizer = load(args.model)
        ref_spec = args.reference or getattr(model, "llmeasyquant_source", None)
        if not args.no_reference and ref_spec:
            reference, ref_tokenizer = load_model(ref_spec)
            tokenizer = tokenizer or ref_tokenizer
        elif not args.no_reference:
            log.warning("the checkpoint names no source model; pass --reference MODEL for KL and top-1")
    else:
        model, tokenizer = load_model(args.model)
        if args.reference and not args.no_reference:
            reference, _ = load_model(args.reference)
    if tokenizer is None:
        raise LLMEasyQuantError(f"{args.model} has no tokenizer files; pass --reference MODEL to borrow its tokenizer")
    kv_cache = _eval_kv_cache(args, model, tokenizer)
    result = evaluate(model, tokenizer, args.text, args.seqlen, args.max_windows, reference, args.seed,
                      name=str(args.model), progress=not args.quiet, kv_cache=kv_cache, command=args.command_line)
    m, p = result.metrics, result.protocol
    line = f"ppl {m['ppl']:.4f} over {m['tokens']} tokens ({m['windows']} windows of {p['seqlen']}, {p['text_source']})"
    if kv_cache is not None:
        line += f", KV cache {kv_cache.config.name}"
    if "kld" in m:
        line += f"; reference ppl {m['ppl_reference']:.4f}, KL {m['kld']:.5f}, top-1 {100 * m['top1']:.2f}%"
    print(line)
    if args.json:
        write_records(args.json, result)


def _eval_kv_cache(args: argparse.Namespace, model: torch.nn.Module, tokenizer: object):
    """The KV cache `eval` runs with: one --kv-bits describes (calibrated now), else the checkpoint's own."""
    kv = build_simquant(args)
    if kv is not None:
        return kv.calibrate(model, build_calibration(args, [], model, tokenizer), progress=not args.quiet)
    info = getattr(model, "llmeasyquant", None)
    if args.no_kv_cache or info is None:
        return None
    return info.kv_cache
