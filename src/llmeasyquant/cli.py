"""llmeasyquant quantize | eval | compare | search | export | bench | report: a thin layer over the Python API."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from llmeasyquant.bench_cli import add_bench_parser, cmd_bench
from llmeasyquant.cli_options import (
    DEFAULT_MODEL,
    DEFAULT_SCHEMES,
    METHOD_HELP,
    add_calib_text_options,
    add_calibration_options,
    add_eval_options,
    add_kv_options,
    add_scheme_options,
)
from llmeasyquant.errors import LLMEasyQuantError
from llmeasyquant.export_cli import add_export_parser, cmd_export
from llmeasyquant.report_cli import add_report_parser, cmd_report
from llmeasyquant.search_cli import add_search_parser, cmd_search

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

    q = sub.add_parser("quantize", help="quantize a model and save the checkpoint")
    q.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    add_scheme_options(q)
    q.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.add_argument("--stream", action="store_true", help="for a Hugging Face folder: read each block's weights only "
                   "when it is quantized, so at most two blocks' float weights are ever in memory")
    q.add_argument("--seed", type=int, default=0, help="seed for generated calibration text")
    q.add_argument("--json", type=Path, help="write the result record to this JSON file")

    e = sub.add_parser("eval", help="perplexity (and KL / top-1 against the unquantized model) of a checkpoint")
    e.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="checkpoint folder or model spec")
    add_eval_options(e, None)
    e.add_argument("--reference", help="unquantized model for KL / top-1 (default: the checkpoint's source model)")
    e.add_argument("--no-reference", action="store_true", help="perplexity only")
    add_kv_options(e)
    add_calib_text_options(e)
    e.add_argument("--no-kv-cache", action="store_true",
                   help="evaluate a checkpoint with an unquantized KV cache even when it carries a quantized one")

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
    add_search_parser(sub)
    add_export_parser(sub)
    add_bench_parser(sub)
    add_report_parser(sub)
    return parser


def _scheme_or_plan(args: argparse.Namespace, recipe: list):
    from llmeasyquant.plan import Plan, Rule
    from llmeasyquant.scheme import parse_scheme

    body = _body_scheme_or_plan(args, recipe)
    if args.lm_head is None:
        return body
    head = parse_scheme(args.lm_head)
    if head.act is not None:
        raise LLMEasyQuantError(f"--lm-head {args.lm_head}: the LM head takes a weight-only scheme (e.g. w8a16), "
                                "its input is not calibrated")
    rules = body.rules if isinstance(body, Plan) else Plan.uniform(body).rules
    return Plan((Rule("lm_head", head), *rules))


def _body_scheme_or_plan(args: argparse.Namespace, recipe: list):
    from llmeasyquant.api import default_scheme
    from llmeasyquant.plan import Plan
    from llmeasyquant.scheme import make_scheme

    if args.plan is not None:
        return Plan.load(args.plan)
    mode = act_mode(args)
    if (args.bits, args.group_size, args.act_bits, mode) == (None, None, None, None) and not args.asym:
        return default_scheme(recipe)
    return make_scheme(8 if args.bits is None else args.bits, args.group_size, not args.asym,
                       16 if args.act_bits is None else args.act_bits, act_mode=mode,
                       momentum=args.act_momentum, eps=args.act_eps, std_floor=args.act_std_floor)


def act_mode(args: argparse.Namespace) -> str | None:
    """--act-mode, with --static as its older spelling; None when neither is given."""
    mode = getattr(args, "act_mode", None)
    if getattr(args, "static", False):
        if mode not in (None, "static"):
            raise LLMEasyQuantError(f"--static contradicts --act-mode {mode}; give one of them")
        return "static"
    return mode


def _simquant(args: argparse.Namespace):
    """The SimQuant that --kv-bits and its options describe, or None without --kv-bits."""
    if args.kv_bits is None:
        return None
    from llmeasyquant.methods.simquant import SimQuant
    from llmeasyquant.nn.kv_cache import KVQuantConfig

    config = KVQuantConfig(key_bits=args.kv_bits, value_bits=args.kv_bits, outliers=args.kv_outliers,
                           sinks=args.kv_sinks, key_channels=args.kv_key_channels, levels=args.kv_levels,
                           key_block=args.kv_key_block)
    if args.calib is None:
        log.info("no --calib text: the KV cache tracks key ranges online")
    return SimQuant(config)


def _method_options(args: argparse.Namespace) -> dict:
    given = {"act_order": args.act_order, "alpha": args.alpha, "lkd": args.lkd, "steps": args.lkd_steps,
             "lr": args.lkd_lr, "samples": args.lkd_samples, "lkd_inputs": args.lkd_inputs}
    return {key: value for key, value in given.items() if value is not None}


def _recipe(args: argparse.Namespace) -> list:
    """The recipe `--method` names (`rtn`, `gptq`, `smoothquant`, `smoothquant+gptq`) with its options."""
    from llmeasyquant.methods import recipe_by_name

    recipe = recipe_by_name(args.method, **_method_options(args))
    static = act_mode(args) == "static"
    if (any(m.needs_calibration for m in recipe) or static) and not args.calib:
        what = "static activation scales" if static else args.method
        raise LLMEasyQuantError(f"{what} needs calibration text: pass --calib wikitext2 (shipped "
                                "WikiText-2 validation), --calib PATH or --calib self")
    return recipe


def _calibration(args: argparse.Namespace, recipe: list, model: torch.nn.Module, tokenizer: object):
    from llmeasyquant.calibration.data import calibration_ids

    wanted = any(getattr(m, "needs_calibration", False) for m in recipe) or act_mode(args) == "static"
    if not wanted and not (getattr(args, "kv_bits", None) is not None and args.calib):
        return None
    ids, source = calibration_ids(args.calib, model, tokenizer, args.calib_samples, args.calib_seqlen, args.seed)
    log.info("calibrating on %s: %d samples of %d tokens", source.description, ids.shape[0], ids.shape[1])
    return ids


def cmd_quantize(args: argparse.Namespace) -> None:
    from llmeasyquant import load_model, quantize
    from llmeasyquant.eval.report import record, write_json
    from llmeasyquant.export.checkpoint import bits_per_weight, checkpoint_bytes
    from llmeasyquant.fileio import check_output

    recipe = _recipe(args)
    plan = _scheme_or_plan(args, recipe)
    kv = _simquant(args)
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
    calib = _calibration(args, recipe, model, tokenizer)
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
        protocol = {"method": args.method, "recipe": model.llmeasyquant.recipe, "plan": model.llmeasyquant.plan,
                    "seed": args.seed,
                    "calib": args.calib, "calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen}
        write_json(args.json, record("quantize", args.model, metrics, protocol))


def _save_on_writer(model: torch.nn.Module, out: Path, tokenizer: object, force: bool) -> Path | None:
    """Rank 0 writes the checkpoint (every rank holds the same weights) and gets its path; the others get None
    once it is complete."""
    from llmeasyquant import distributed, save

    folder = save(model, out, tokenizer, force=force) if distributed.is_writer() else None
    distributed.barrier()
    return folder


def cmd_eval(args: argparse.Namespace) -> None:
    from llmeasyquant import evaluate, load, load_model
    from llmeasyquant.eval.report import write_json
    from llmeasyquant.export.checkpoint import is_checkpoint

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
                      name=str(args.model), progress=not args.quiet, kv_cache=kv_cache)
    m, p = result["metrics"], result["protocol"]
    line = f"ppl {m['ppl']:.4f} over {m['tokens']} tokens ({m['windows']} windows of {p['seqlen']}, {p['text_source']})"
    if kv_cache is not None:
        line += f", KV cache {kv_cache.config.name}"
    if "kld" in m:
        line += f"; reference ppl {m['ppl_reference']:.4f}, KL {m['kld']:.5f}, top-1 {100 * m['top1']:.2f}%"
    print(line)
    if args.json:
        write_json(args.json, result)


def _eval_kv_cache(args: argparse.Namespace, model: torch.nn.Module, tokenizer: object):
    """The KV cache `eval` runs with: one --kv-bits describes (calibrated now), else the checkpoint's own."""
    kv = _simquant(args)
    if kv is not None:
        return kv.calibrate(model, _calibration(args, [], model, tokenizer), progress=not args.quiet)
    info = getattr(model, "llmeasyquant", None)
    if args.no_kv_cache or info is None:
        return None
    return info.kv_cache


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
    recipes = [recipe_by_name(m, strict=False, **_method_options(args)) for m in methods]
    needing = [m for m, recipe in zip(methods, recipes, strict=True) if any(r.needs_calibration for r in recipe)]
    if needing and not args.calib:
        raise LLMEasyQuantError(f"{', '.join(needing)} need calibration text: pass --calib wikitext2 (shipped "
                                "WikiText-2 validation), --calib PATH or --calib self")
    return schemes, methods


def cmd_compare(args: argparse.Namespace) -> None:
    from llmeasyquant import compare
    from llmeasyquant.eval.report import COMPARE_COLUMNS, format_table, write_json
    from llmeasyquant.fileio import check_output

    schemes, methods = _compared_rows(args)
    recipe = _recipe(args) if methods is None else args.method  # an unknown method fails now, not after loading
    if args.report is not None:
        check_output(args.report, args.force)
    records = compare(args.model, schemes, recipe, args.text, args.seqlen, args.max_windows, args.keep_fp32,
                      args.workdir, args.seed, progress=not args.quiet, calib=args.calib,
                      calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen, kv=_simquant(args),
                      methods=methods, method_options=_method_options(args),
                      details=args.details or args.report is not None)
    p = records[0]["protocol"]
    kv = f", KV cache {records[-1]['metrics']['kv_cache']}" if "kv_cache" in records[-1]["metrics"] else ""
    what = f"methods {', '.join(methods)}" if methods else f"method {args.method}"
    print(f"\n{args.model}, {what}{kv}: {p['windows']} windows of {p['seqlen']} tokens from "
          f"{p['text_source']} (sha256 {p['text_sha256'][:12]}…), no BOS, {p['threads']} threads\n")
    columns = ((("method", "method", ""),) if methods else ()) + COMPARE_COLUMNS
    print(format_table([r["metrics"] for r in records], columns))
    if args.json:
        write_json(args.json, records)
    if args.report is not None:
        from llmeasyquant.eval.html_report import write_report_html

        print(f"wrote {write_report_html(records, args.report, force=args.force)}")


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "compare": cmd_compare, "search": cmd_search,
            "export": cmd_export, "bench": cmd_bench, "report": cmd_report}


DISTRIBUTED_COMMANDS = ("quantize", "eval")


@contextlib.contextmanager
def _distributed_run(args: argparse.Namespace):
    """Join the process group when asked (or under torchrun); ranks other than 0 print nothing and write nothing."""
    from llmeasyquant import distributed

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
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    import transformers

    from llmeasyquant.eval import report

    report.COMMAND = " ".join(["llmeasyquant", *(sys.argv[1:] if argv is None else argv)])
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
    finally:
        report.COMMAND = None
    log.debug("%s took %.1f s", args.command, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
