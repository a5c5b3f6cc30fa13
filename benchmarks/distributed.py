"""Distributed quantization and evaluation on SmolLM2-135M: 1 process against 2 gloo ranks (torchrun), per method.

    python benchmarks/distributed.py [--methods rtn,gptq,awq,smoothquant,gptaq,zeroquant] [--calib-samples 32]
        [--max-windows 10] [--ranks 2] [--out benchmarks/results/distributed.json]

For each method the same job runs once in one process (2 threads) and once under `torchrun --nproc_per_node N`
(1 thread per rank): quantize with the calibration data (the first `calib-samples` 512-token chunks of WikiText-2
validation), then evaluate on the first `max-windows` 512-token windows of WikiText-2 raw test. Every rank writes
its integer codes; the parent checks that the ranks agree bit for bit, counts the codes equal to the single
process's (and whether every saved tensor is, naming the first that is not), compares perplexities, and evaluates
the distributed run's checkpoint in one process to compare with the distributed evaluation of the same weights.
Timing and bytes each rank put into collectives per block are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = {"rtn": "w4a16-g64-asym", "gptq": "w4a16-g64-asym", "awq": "w4a16-g64-asym", "smoothquant": "w8a8",
           "gptaq": "w4a16-g64-asym", "zeroquant": "w4a8-g64"}
RECIPES = {"rtn": "rtn", "gptq": "gptq", "awq": "awq", "smoothquant": "smoothquant", "gptaq": "gptaq",
           "zeroquant": "zeroquant"}


def worker(args: argparse.Namespace) -> None:
    """One rank (or the single process): quantize, save codes, evaluate; writes rank{R}.json / .safetensors."""
    import llmeasyquant as lq
    from llmeasyquant.calibration.data import calibration_ids, load_text
    from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
    from llmeasyquant.infra import distributed
    from llmeasyquant.methods import recipe_by_name

    if distributed.launched_by_torchrun():
        distributed.init("gloo", 600)
    out = Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = lq.load_model("smollm2-135m")
    calib, _ = calibration_ids("wikitext2", model, tokenizer, args.calib_samples, 512)
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    start = time.perf_counter()
    lq.quantize(model, recipe_by_name(RECIPES[args.method]), lq.parse_scheme(SCHEMES[args.method]), calib=calib,
                progress=False)
    quantize_s = time.perf_counter() - start
    rank = distributed.rank()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k.endswith(("qweight", "scales", "zeros"))},
              str(out / f"rank{rank}.safetensors"))
    if distributed.is_writer():
        lq.save(model, out / "checkpoint", tokenizer, force=True)
    distributed.barrier()
    start = time.perf_counter()
    metrics = evaluate_windows({"model": model}, windows, progress=False)["model"]
    eval_s = time.perf_counter() - start
    (out / f"rank{rank}.json").write_text(json.dumps({
        "quantize_s": quantize_s, "eval_s": eval_s, "ppl": metrics["ppl"], "nll": metrics["nll"],
        "world": distributed.world(), "threads": torch.get_num_threads(),
        "sent_bytes_per_block": [b.sent_bytes for b in model.llmeasyquant.blocks]}))
    distributed.shutdown()


def launch(method: str, ranks: int, workdir: Path, args: argparse.Namespace) -> list[dict]:
    script = [str(Path(__file__).resolve()), "--worker", "--method", method, "--workdir", str(workdir),
              "--calib-samples", str(args.calib_samples), "--max-windows", str(args.max_windows)]
    if ranks == 1:
        command, env = [sys.executable, *script], dict(os.environ, OMP_NUM_THREADS="2")
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   *script]
        env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    print(f"{method} on {ranks} rank(s): {time.perf_counter() - start:.1f} s wall", flush=True)
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(ranks)]


def compare(method: str, args: argparse.Namespace) -> dict:
    import llmeasyquant as lq
    from llmeasyquant.calibration.data import load_text
    from llmeasyquant.eval.perplexity import evaluate_windows, make_windows

    base = Path(args.workdir) / method
    single = launch(method, 1, base / "single", args)[0]
    multi = launch(method, args.ranks, base / "multi", args)
    codes = [load_file(base / "multi" / f"rank{r}.safetensors") for r in range(args.ranks)]
    alone = load_file(base / "single" / "rank0.safetensors")
    ranks_agree = all(torch.equal(codes[0][k], c[k]) for c in codes[1:] for k in codes[0])
    differing = [k for k in alone if not torch.equal(alone[k], codes[0][k])]  # in the model's order
    keys = [k for k in alone if k.endswith("qweight")]
    same = sum(int((alone[k] == codes[0][k]).sum()) for k in keys)
    total = sum(alone[k].numel() for k in keys)
    model, tokenizer = lq.load(base / "multi" / "checkpoint")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    one_process = evaluate_windows({"model": model}, windows, progress=False)["model"]
    return {
        "method": method, "scheme": SCHEMES[method], "ranks": args.ranks, "ranks_bit_identical": ranks_agree,
        "checkpoint_identical": not differing, "tensors_differing": len(differing), "tensors": len(alone),
        "first_difference": differing[0] if differing else None, "codes_identical_pct": 100 * same / total,
        "ppl_single": single["ppl"], "ppl_distributed": multi[0]["ppl"],
        "ppl_rel_diff": multi[0]["ppl"] / single["ppl"] - 1,
        "eval_rel_diff_same_weights": multi[0]["nll"] / one_process["nll"] - 1,
        "quantize_s_single": single["quantize_s"], "quantize_s_distributed": max(m["quantize_s"] for m in multi),
        "eval_s_single": single["eval_s"], "eval_s_distributed": max(m["eval_s"] for m in multi),
        "sent_bytes_per_block": [m["sent_bytes_per_block"] for m in multi]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", default="rtn,gptq,awq,smoothquant")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--max-windows", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/llmeasyquant-distributed")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/distributed.json")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    from llmeasyquant.record import Record, write_records

    rows = [compare(m.strip(), args) for m in args.methods.split(",") if m.strip()]
    for row in rows:
        print({k: v for k, v in row.items() if k != "sent_bytes_per_block"})
    protocol = {"calib": "WikiText-2 validation, first chunks", "calib_samples": args.calib_samples,
                "calib_seqlen": 512, "eval": "WikiText-2 raw test", "seqlen": 512, "max_windows": args.max_windows,
                "backend": "gloo", "threads_single": 2, "threads_per_rank": 1}
    write_records(args.out, Record.new("distributed", "smollm2-135m", {"rows": rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
