"""`llmeasyquant bench`: prefill and decode speed, memory and the latency breakdown, against the float model."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from llmeasyquant.cli.options import DEFAULT_MODEL
from llmeasyquant.errors import LLMEasyQuantError
from llmeasyquant.eval.speed import RUNTIMES


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="prefill/decode tokens per second, memory and latency breakdown of a checkpoint "
                       "or model, with the unquantized model measured in the same run")
    b.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="checkpoint folder or model spec")
    b.add_argument("--baseline", help="unquantized model measured beside it (default: the checkpoint's source "
                   "model); 'none' to measure the model alone")
    b.add_argument("--thread-counts", help="comma-separated torch thread counts to measure with, e.g. 1,2 "
                   "(default: the current setting, see --threads)")
    b.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for decode (default 128)")
    b.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated (default 64)")
    b.add_argument("--prefill-tokens", type=int, default=512, help="length of the long prefill (default 512)")
    b.add_argument("--batch", type=int, default=16, help="sequences decoded together in the timed batched step, "
                   "the step `serve` runs for that many clients (default 16; 0 to skip)")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    b.add_argument("--text", help="take the prompt from this text: a file, or a shipped text such as 'wikitext2' "
                   "(default: seeded random tokens)")
    b.add_argument("--no-breakdown", action="store_true", help="skip the profiled latency breakdown")
    b.add_argument("--runtime", choices=RUNTIMES, default="auto", help="decode loop for the measured model: 'lean' "
                   "(the serving engine's forward, the path generate, chat and serve run: a paged KV cache and the "
                   "blocks in one native call; families with a decoder map), 'lean-pytorch' "
                   "(the same forward on PyTorch operators only), 'transformers' (its own forward) or "
                   "'auto' (lean where the family has it, else transformers; the default). The float baseline runs "
                   "on transformers and, when the measured model runs lean, on the lean loop too, so the gain of "
                   "the loop and of the quantization show apart")
    b.add_argument("--no-fuse", action="store_true", help="run q/k/v and gate/up as separate GEMMs (default: "
                   "layers that read one input run as one GEMM; results are the same)")
    b.add_argument("--no-huge-pages", action="store_true", help="keep the weights where loading put them (default: "
                   "every measured model's weights, the float baseline's too, move onto 2 MiB transparent huge "
                   "pages where the system has them: fewer TLB misses as a decode step streams them; results are "
                   "the same)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", type=Path, help="write the result records to this JSON file")
    b.add_argument("--plot", type=Path, help="write the latency breakdown as a stacked bar chart (PNG), for the "
                   "largest thread count")
    b.add_argument("--force", action="store_true", help="replace --plot if it exists")


def _prompt(args: argparse.Namespace, tokenizer: object, vocab: int, length: int) -> tuple[torch.Tensor, str]:
    if args.text is None:
        generator = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab, (1, length), generator=generator), f"random tokens, seed {args.seed}"
    from llmeasyquant.calibration.data import load_text, tokenize

    source = load_text(args.text)
    ids = tokenize(tokenizer, source.text)
    if ids.numel() < length:
        raise LLMEasyQuantError(f"{args.text} gives {ids.numel()} tokens; bench needs {length}: use a longer text")
    return ids[:length].reshape(1, length), source.description


def cmd_bench(args: argparse.Namespace) -> None:
    from llmeasyquant import fuse_shared_inputs, load, load_model
    from llmeasyquant.eval.bench import BenchConfig, bench, layer_lines, summary_lines, thread_counts
    from llmeasyquant.export.checkpoint import is_checkpoint
    from llmeasyquant.nn.placement import place_on_huge_pages
    from llmeasyquant.record import Record, write_records

    if args.plot is not None:
        from llmeasyquant.infra.files import check_output

        if args.no_breakdown:
            raise LLMEasyQuantError("--plot draws the latency breakdown, which --no-breakdown skips: drop one")
        check_output(args.plot, args.force)  # fail before the measurement, not after
    config = BenchConfig(args.prompt_tokens, args.new_tokens, args.prefill_tokens, args.repeats,
                         thread_counts(args.thread_counts), not args.no_breakdown, args.runtime, args.batch)
    if is_checkpoint(args.model):
        model, tokenizer = load(args.model)
        baseline_spec = args.baseline or getattr(model, "llmeasyquant_source", None)
    else:
        model, tokenizer = load_model(args.model)
        baseline_spec = args.baseline
    fused = 0 if args.no_fuse else fuse_shared_inputs(model)
    from llmeasyquant.eval.speed import resolve_runtime

    runtime = resolve_runtime(model, args.runtime)
    models = {str(args.model): model.eval()}
    runtimes = {str(args.model): runtime}
    if baseline_spec and baseline_spec.lower() != "none":
        baseline, base_tokenizer = load_model(baseline_spec)
        float_models = {f"{baseline_spec} (float)": baseline.eval()}
        runtimes[f"{baseline_spec} (float)"] = "transformers"
        if runtime != "transformers":
            float_models[f"{baseline_spec} (float, {runtime})"] = baseline
            runtimes[f"{baseline_spec} (float, {runtime})"] = runtime
        models = float_models | models
        tokenizer = tokenizer or base_tokenizer
    elif args.baseline is None and is_checkpoint(args.model):
        raise LLMEasyQuantError("the checkpoint names no source model to compare with: pass --baseline MODEL "
                                "(or --baseline none)")
    prompt, source = _prompt(args, tokenizer, model.config.vocab_size, max(args.prompt_tokens, args.prefill_tokens))
    moved: dict[int, int] = {}  # bytes moved per model object: one float model can run on two runtimes
    for m in models.values():
        if not args.no_huge_pages and id(m) not in moved:
            moved[id(m)] = place_on_huge_pages(m)
    huge_pages = {name: moved.get(id(m), 0) for name, m in models.items()}
    baseline_name = next(iter(models)) if len(models) > 1 else None
    rows = bench(models, prompt, config, baseline=baseline_name, progress=not args.quiet, runtimes=runtimes)
    print("\n".join(summary_lines(rows) + layer_lines(rows)))
    protocol = {"decode_batch": 1, "text_source": source, "greedy": True, **vars(config) | {"threads": None},
                "thread_counts": list(config.threads), "baseline": baseline_name, "fused_groups": fused,
                "huge_page_bytes": huge_pages}
    records = [Record.new("bench", row["model"], row, protocol | {"threads": row["threads"]}, args.command_line)
               for row in rows]
    if args.json:
        write_records(args.json, records)
    if args.plot is not None:
        from llmeasyquant.report.compare_figures import plot_latency_breakdown

        most = max(row["threads"] for row in rows)
        print(f"wrote {plot_latency_breakdown([r for r in records if r.metric('threads') == most], args.plot)}")
