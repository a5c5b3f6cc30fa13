"""llmeasyquant search: per-layer mixed precision under a size budget, written as a plan JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmeasyquant.cli.options import DEFAULT_MODEL, add_calib_text_options, add_eval_options
from llmeasyquant.errors import LLMEasyQuantError

SEARCH_METHODS = ("gptq", "rtn", "rotate+gptq", "rotate+rtn")


def add_search_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("search", help="per-layer mixed precision under a size budget; writes a plan JSON")
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    budget = s.add_mutually_exclusive_group(required=True)
    budget.add_argument("--avg-bits", type=float, help="average stored bits per quantized weight, scales included")
    budget.add_argument("--max-mb", type=float, help="MB (2^20 bytes) of stored tensors: quantized layers plus the "
                        "float tensors (embeddings, norms) in fp16")
    s.add_argument("--candidates", default="2,3,4,8",
                   help="bit widths to choose from (default 2,3,4,8), or weight-only scheme names, each with its own "
                   "group, symmetry and grid (e.g. w3a16-g64-asym,w4a16-g64-learned,w8a16-g64)")
    s.add_argument("--group-size", type=int, default=128,
                   help="weights per scale, every bit-width candidate (default 128)")
    s.add_argument("--per-channel", action="store_true", help="one scale per output channel instead of groups")
    s.add_argument("--sym", action="store_true", help="symmetric weights (default asymmetric, zero points)")
    s.add_argument("--method", choices=SEARCH_METHODS, default="gptq",
                   help="the recipe the plan is for; its quantizer makes each candidate's weights, on the model "
                   "its rotation (if any) leaves (default gptq)")
    s.add_argument("--sensitivity", choices=("kl", "output", "hessian", "entropy"), default="kl",
                   help="kl: measured KL with one layer quantized; output: the layer's output error; hessian: "
                   "Hessian trace x weight error (HAWQ-v2); entropy: data-free (default kl)")
    s.add_argument("--solver", choices=("exact", "greedy"), default="exact",
                   help="exact: dynamic programming (optimal); greedy: the paper's coordinate descent")
    s.add_argument("--lam", type=float, default=0.0, help="λ of loss + λ·bits: > 0 trades quality for size")
    s.add_argument("--probe-samples", type=int, default=2, help="calibration samples for KL / Hessian (default 2)")
    s.add_argument("--probe-tokens", type=int, default=256, help="their length in tokens (default 256)")
    add_calib_text_options(s)
    s.add_argument("--out", type=Path, required=True, help="plan JSON to write")
    s.add_argument("--force", action="store_true", help="replace --out (and --plot) if it exists")
    s.add_argument("--plot", type=Path, help="PNG of the bits chosen per layer (needs matplotlib: [report])")
    s.add_argument("--verify", action="store_true",
                   help="quantize with the plan and evaluate it: measured size and quality beside the predicted")
    add_eval_options(s, 40)


def cmd_search(args: argparse.Namespace) -> None:
    from llmeasyquant import load_model
    from llmeasyquant.infra.files import check_output
    from llmeasyquant.record import Record, write_records
    from llmeasyquant.search import Budget, MixedPrecisionSearch
    from llmeasyquant.search.verify import verify_plan

    widths, names = _candidates(args.candidates)
    search = MixedPrecisionSearch(
        candidates=widths, group_size=None if args.per_channel else args.group_size, symmetric=args.sym,
        method=args.method, candidate_schemes=names, sensitivity=args.sensitivity, solver=args.solver,
        lam=args.lam, probe_samples=args.probe_samples, probe_tokens=args.probe_tokens)
    budget = Budget(avg_bits=args.avg_bits, max_bytes=None if args.max_mb is None else int(args.max_mb * 2**20))
    for path in (args.out, args.plot):
        if path is not None:
            check_output(path, args.force)
    if search.needs_calibration and not args.calib:
        raise LLMEasyQuantError(f"the {args.sensitivity} sensitivity with {search.quantizer} needs calibration text: "
                                "pass --calib wikitext2 (shipped WikiText-2 validation), --calib PATH or --calib self")
    model, tokenizer = load_model(args.model)
    calib = None
    if args.calib:
        from llmeasyquant.calibration.data import SELF_TEXT, calibration_ids, load_text

        calib, source = calibration_ids(args.calib, model, tokenizer, args.calib_samples, args.calib_seqlen,
                                        args.seed)
        if args.verify and str(args.text).lower() != SELF_TEXT and load_text(args.text).sha256 == source.sha256:
            raise LLMEasyQuantError("--calib and --text are the same text; calibrate on another split (e.g. "
                                    "WikiText-2 validation) than the one --verify evaluates on")
    result = search.run(model, calib, budget, progress=not args.quiet)
    p = result.predicted
    print(f"plan for {budget.label()}: {p['avg_bits']:.3f} bits per quantized weight, {p['tensor_bytes'] / 2**20:.2f}"
          f" MB of tensors, predicted {args.sensitivity} loss {p['loss']:.4g}"
          f"{'' if p['optimal'] else ' (not proven optimal)'}; searched in {result.search_s:.1f} s")
    shares = result.scheme_histogram()
    print("weights per candidate: " + ", ".join(f"{name} {100 * n / sum(shares.values()):.1f}%"
                                                for name, n in shares.items()))
    if args.verify:
        verify_plan(result, model, tokenizer, calib, args.text, args.seqlen, args.max_windows, args.seed,
                    progress=not args.quiet)
        m = result.measured
        print(f"measured: {m['bits_per_weight']:.3f} bits per weight, {m['tensor_bytes'] / 2**20:.2f} MB of tensors, "
              f"ppl {m['ppl']:.3f} (fp32 {m['ppl_reference']:.3f}), KL {m['kld']:.5f}")
    result.save(args.out, force=args.force)
    calib = " --calib PATH" if search.quantizer == "gptq" else ""
    print(f"wrote {args.out}; apply it with: llmeasyquant quantize {args.model} --method {args.method} "
          f"--plan {args.out}{calib} --out DIR")
    if args.plot:
        from llmeasyquant.report.plots import plot_bits_per_layer

        plot_bits_per_layer(result, args.plot)
    if args.json:
        protocol = {"calib": args.calib, "calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen,
                    "seed": args.seed, "search": result.to_dict()["search"]["config"]}
        metrics = {"search_s": result.search_s, **p, **{f"measured_{k}": v for k, v in result.measured.items()}}
        write_records(args.json, Record.new("search", args.model, metrics, protocol, args.command_line))


def _candidates(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(bit widths, ()) for `2,3,4,8`; ((4,), scheme names) for names such as `w3a16-g64-asym,w4a16-g64`."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise LLMEasyQuantError("--candidates is empty; give bit widths such as 2,3,4,8 or scheme names such as "
                                "w3a16-g64-asym,w4a16-g64-learned")
    if all(part.isdigit() for part in parts):
        return tuple(int(part) for part in parts), ()
    if any(part.isdigit() for part in parts):
        raise LLMEasyQuantError(f"--candidates mixes bit widths and scheme names ({text!r}); give only bit widths "
                                "(2,3,4,8) or only scheme names (w3a16-g64-asym,w4a16-g64)")
    return (4,), tuple(parts)
