"""`llmeasyquant export DIR --to compressed-tensors|gguf|onnx --out PATH`: write the checkpoint in a runtime's
format, then check it in that runtime against our own evaluation of the same checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmeasyquant.cli.options import add_eval_options
from llmeasyquant.export.formats import FORMATS


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export", help="export a quantized checkpoint to compressed-tensors, GGUF or ONNX and check "
                       "it in its runtime")
    x.add_argument("checkpoint", type=Path, help="quantized checkpoint folder (from llmeasyquant quantize)")
    x.add_argument("--to", required=True, choices=tuple(FORMATS), help="target format")
    x.add_argument("--out", type=Path, required=True, help="file (gguf) or folder (compressed-tensors, onnx) to write")
    x.add_argument("--force", action="store_true", help="replace --out if it exists")
    x.add_argument("--no-check", action="store_true",
                   help="skip the check in the target runtime (perplexity and logits against ours)")
    add_eval_options(x, 10)


def _check_line(check: dict) -> str:
    if "skipped" in check:
        return f"check in {check['runtime']} skipped: {check['skipped']}"
    return (f"{check['runtime']}: ppl {check['ppl_runtime']:.4f} vs ours {check['ppl_ours']:.4f} "
            f"({check['ppl_rel_diff_pct']:+.3f}%), max |logit difference| {check['max_abs_logit_diff']:.2e}, "
            f"loaded in {check['load_s']:.1f} s ({check['windows']} windows)")


def cmd_export(args: argparse.Namespace) -> None:
    from llmeasyquant import load
    from llmeasyquant.eval.export_check import check_export
    from llmeasyquant.export.formats import export_format
    from llmeasyquant.jobs.evaluate import prepare_windows
    from llmeasyquant.record import Record, write_records

    model, tokenizer = load(args.checkpoint)
    result = export_format(args.to).write(model, tokenizer, args.out, force=args.force)
    info = result.to_dict()
    requantized = f"; re-quantized: {', '.join(result.requantized)}" if result.requantized else ""
    print(f"wrote {args.to} {result.path} ({info['bytes'] / 1e6:.1f} MB, {len(result.lossless)} layers exact"
          f"{requantized}) in {result.seconds:.1f} s")
    protocol: dict = {}
    if not args.no_check:
        if tokenizer is None:
            print("check skipped: the checkpoint has no tokenizer to cut the evaluation text with")
        else:
            windows = prepare_windows(model, tokenizer, args.text, args.seqlen, args.max_windows, args.seed)
            protocol = windows.protocol
            info["check"] = check_export(result.path, args.to, model, windows, progress=not args.quiet)
            print(_check_line(info["check"]))
    if args.json:
        write_records(args.json, Record.new("export", str(args.checkpoint), info, protocol, args.command_line))
