"""`llmeasyquant quantize`: quantize a model with a recipe and a scheme or plan, save the checkpoint."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from llmeasyquant.cli.options import DEFAULT_MODEL, add_scheme_options
from llmeasyquant.cli.resolve import (
    apply_preset,
    build_calibration,
    build_recipe,
    build_scheme_or_plan,
    build_simquant,
)
from llmeasyquant.errors import LLMEasyQuantError

log = logging.getLogger("llmeasyquant")


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    """The `quantize` subcommand's options."""
    q = sub.add_parser("quantize", help="quantize a model and save the checkpoint")
    q.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    add_scheme_options(q)
    q.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.add_argument("--stream", action="store_true", help="for a Hugging Face folder: read each block's weights only "
                   "when it is quantized, so at most two blocks' float weights are ever in memory")
    q.add_argument("--seed", type=int, default=0, help="seed for generated calibration text")
    q.add_argument("--json", type=Path, help="write the result record to this JSON file")


def cmd_quantize(args: argparse.Namespace) -> None:
    from llmeasyquant import load_model, quantize
    from llmeasyquant.export.checkpoint import bits_per_weight, checkpoint_bytes
    from llmeasyquant.infra.files import check_output
    from llmeasyquant.record import Record, write_records

    apply_preset(args)
    recipe = build_recipe(args)
    plan = build_scheme_or_plan(args, recipe)
    kv = build_simquant(args)
    check_output(args.out, args.force)  # fail before minutes of work, not after
    stream = None
    if args.stream:
        from llmeasyquant.models.streaming import load_model_streamed

        if args.calib == "self":
            raise LLMEasyQuantError("--stream reads each block only when it is quantized, so the model cannot write "
                                    "its own calibration text first: pass --calib PATH")
        model, tokenizer, stream = load_model_streamed(args.model)
    else:
        model, tokenizer = load_model(args.model)
    calib = build_calibration(args, recipe, model, tokenizer)
    quantize(model, recipe + ([kv] if kv else []), plan, calib=calib, keep_fp32=args.keep_fp32,
             progress=not args.quiet, stream=stream)
    folder = _save_on_writer(model, args.out, tokenizer, args.force)
    if folder is None:
        return  # another rank wrote it, and reports it
    metrics = {"quantize_s": model.llmeasyquant.quantize_s, "checkpoint_bytes": checkpoint_bytes(folder),
               "bits_per_weight": bits_per_weight(model)}
    what = plan.name if hasattr(plan, "name") else f"plan {args.plan}" if args.plan else ", ".join(
        f"{rule.pattern} {rule.scheme.name if rule.scheme else 'float'}" for rule in plan.rules)
    if kv is not None:
        what += f", KV cache {kv.config.name}"
    print(f"saved {folder} ({'+'.join(m.name for m in recipe)}, {what}): {metrics['checkpoint_bytes'] / 2**20:.1f} MB, "
          f"{metrics['bits_per_weight']:.3f} bits per quantized weight, quantized in {metrics['quantize_s']:.1f} s")
    if args.json:
        protocol = {"method": args.method, "preset": args.preset, "recipe": model.llmeasyquant.recipe,
                    "plan": model.llmeasyquant.plan, "seed": args.seed, "calib": args.calib,
                    "calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen}
        fallbacks = model.llmeasyquant.calibration.get("fallbacks")
        if fallbacks:  # experts that read too few calibration tokens, and what the methods did instead
            protocol["fallbacks"] = fallbacks
        write_records(args.json, Record.new("quantize", args.model, metrics, protocol, args.command_line))


def _save_on_writer(model: torch.nn.Module, out: Path, tokenizer: object, force: bool) -> Path | None:
    """Rank 0 writes the checkpoint (every rank holds the same weights) and gets its path; the others get None
    once it is complete."""
    from llmeasyquant import save
    from llmeasyquant.infra import distributed

    folder = save(model, out, tokenizer, force=force) if distributed.is_writer() else None
    distributed.barrier()
    return folder
