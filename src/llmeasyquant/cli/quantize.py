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
                   "when it is quantized and write it to a sharded checkpoint as soon as it is done, so memory holds "
                   "about one block (plus the input embeddings in 16 bits), whatever the model's size")
    q.add_argument("--estimate", action="store_true", help="with --stream: first time the first one and two blocks "
                   "and log the estimated time of the whole run (costs about three blocks' time)")
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
    if args.estimate and not args.stream:
        raise LLMEasyQuantError("--estimate times the first blocks of a streamed run: add --stream")
    metrics: dict = {}
    if args.stream:
        if args.calib == "self":
            raise LLMEasyQuantError("--stream reads each block only when it is quantized, so the model cannot write "
                                    "its own calibration text first: pass --calib PATH")
        model, folder = _quantize_streamed(args, recipe + ([kv] if kv else []), plan, metrics)
    else:
        model, tokenizer = load_model(args.model)
        calib = build_calibration(args, recipe, model, tokenizer)
        quantize(model, recipe + ([kv] if kv else []), plan, calib=calib, keep_fp32=args.keep_fp32,
                 progress=not args.quiet)
        folder = _save_on_writer(model, args.out, tokenizer, args.force)
    if folder is None:
        return  # another rank wrote it, and reports it
    seconds = sorted(b.seconds for b in model.llmeasyquant.blocks)
    metrics = {"quantize_s": model.llmeasyquant.quantize_s, "checkpoint_bytes": checkpoint_bytes(folder),
               "bits_per_weight": bits_per_weight(model), "blocks": len(seconds),
               "block_s_median": seconds[len(seconds) // 2] if seconds else None,
               "block_s_max": seconds[-1] if seconds else None} | metrics
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


def _quantize_streamed(args: argparse.Namespace, recipe: list, plan: object, metrics: dict
                       ) -> tuple[torch.nn.Module, Path | None]:
    """Quantize block by block from the folder, each block written to a sharded checkpoint as soon as it is done
    (by rank 0; the other ranks only release theirs). Adds the estimate to `metrics` when one is asked for."""
    from llmeasyquant import quantize
    from llmeasyquant.export.sharded import ShardedWriter
    from llmeasyquant.infra import distributed
    from llmeasyquant.infra.files import staged_folder
    from llmeasyquant.infra.memory import map_large_allocations
    from llmeasyquant.models.streaming import load_model_streamed

    map_large_allocations()  # freed tensors leave the resident size at once, not only at the next trim
    model, tokenizer, stream = load_model_streamed(args.model, hollow=True)
    calib = build_calibration(args, recipe, model, tokenizer)
    if args.estimate:
        from llmeasyquant.jobs.estimate import quantize_seconds

        metrics["estimate_s"] = quantize_seconds(model, recipe, plan, calib, stream=stream)
        log.info("estimated quantization time: %.0f s (from the first one and two blocks timed now)",
                 metrics["estimate_s"])

    def run() -> None:
        quantize(model, recipe, plan, calib=calib, keep_fp32=args.keep_fp32, progress=not args.quiet, stream=stream)

    folder = None
    if distributed.is_writer():
        with staged_folder(args.out, args.force) as tmp:
            writer = ShardedWriter(tmp, torch.float32 if args.keep_fp32 else torch.float16)
            stream.sink = writer.add_block
            run()
            writer.finish(model, stream, tokenizer)
        folder = args.out
    else:
        stream.sink = lambda _prefix, _block: None  # rank 0 writes; the blocks here are only released
        run()
    distributed.barrier()
    return model, folder


def _save_on_writer(model: torch.nn.Module, out: Path, tokenizer: object, force: bool) -> Path | None:
    """Rank 0 writes the checkpoint (every rank holds the same weights) and gets its path; the others get None
    once it is complete."""
    from llmeasyquant import save
    from llmeasyquant.infra import distributed

    folder = save(model, out, tokenizer, force=force) if distributed.is_writer() else None
    distributed.barrier()
    return folder
