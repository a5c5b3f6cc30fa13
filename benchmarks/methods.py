"""Calibrated methods on SmolLM2-135M under the house protocol, all evaluated side by side in one pass.

    python benchmarks/methods.py [--calib-samples 64] [--max-windows 40] [--runs 0,3] [--out FILE.json]
    python benchmarks/methods.py --calib-sweep 16,32 --out benchmarks/results/methods_calib.json

Calibration: the first N consecutive 512-token chunks of WikiText-2 validation (shipped: `wikitext2`).
Evaluation: WikiText-2 raw test, 512-token windows, no BOS. Each quantized model is saved and evaluated as loaded.
"units" = quantization seconds / seconds of an 8-window fp32 evaluation measured just before each run, in this
process. Quantization is deterministic: the same run gives the same model whatever else the table holds.
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys
import tempfile
import time
from pathlib import Path

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids, load_text
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows, make_windows
from llmeasyquant.export.checkpoint import bits_per_weight, checkpoint_bytes
from llmeasyquant.methods import recipe_by_name
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

RUNS = (  # (recipe, scheme, options)
    ("rtn", "w8a8", {}),
    ("smoothquant", "w8a8", {"alpha": 0.8}),
    ("smoothquant", "w8a8", {"alpha": "auto"}),
    ("smoothquant", "w8a8-astatic", {"alpha": 0.8}),
    ("smoothquant+gptq", "w8a8", {"alpha": 0.8}),
    ("rtn", "w4a16-g64", {}),
    ("rtn", "w4a16-g64-asym", {}),
    ("gptq", "w4a16-g64", {}),
    ("gptq", "w4a16-g64", {"act_order": False}),
    ("gptq", "w4a16-g64-asym", {}),
    ("gptq", "w4a16-g128-asym", {}),
    ("awq", "w4a16-g64-asym", {}),
    ("awq+gptq", "w4a16-g64-asym", {}),
    ("zeroquant", "w4a8-g64", {"lkd": False}),
    ("zeroquant", "w4a8-g64", {}),
)
SWEEP_RUNS = "1,7,11,14"  # one row per method for --calib-sweep
COLUMNS = (("method", "method", ""), ("scheme", "scheme", ""), ("calib", "calib_samples", "d"),
           ("bits/w", "bits_per_weight", ".3f"), ("ckpt MB", "checkpoint_mb", ".1f"), ("ppl", "ppl", ".3f"),
           ("KL", "kld", ".5f"), ("top-1 %", "top1_pct", ".2f"), ("quant s", "quantize_s", ".1f"),
           ("units", "quantize_units", ".1f"), ("peak RSS MB", "peak_rss_mb", ".0f"))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--calib-sweep", help="comma-separated sample counts (e.g. 16,32,128): each run is "
                        f"quantized with each; --runs defaults to {SWEEP_RUNS}")
    parser.add_argument("--max-windows", type=int, default=40)
    parser.add_argument("--runs", help="comma-separated indexes into RUNS (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/methods.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.calib_sweep.split(",")] if args.calib_sweep else [args.calib_samples]
    indexes = args.runs or (SWEEP_RUNS if args.calib_sweep else ",".join(map(str, range(len(RUNS)))))
    runs = [(int(i), *RUNS[int(i)]) for i in indexes.split(",")]
    base, tokenizer = lq.load_model("smollm2-135m")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    calib, source = calibration_ids("wikitext2", base, tokenizer, max(counts), 512)
    unit_windows = EvalWindows(windows.ids[:8], windows.protocol)
    models, rows = {"fp32": base}, {"fp32": {"method": "fp32", "scheme": "-"}}
    with tempfile.TemporaryDirectory() as scratch:
        for index, recipe_name, scheme_name, options in runs:
            for count in counts:
                recipe = recipe_by_name(recipe_name, **options)
                scheme = lq.parse_scheme(scheme_name)
                extras = "".join(f" {k}={v}" for k, v in options.items())
                label = f"{index}:{recipe_name}{extras}" + (f" n={count}" if args.calib_sweep else "")
                # RTN is timed without a calibration pass; static activation scales need one.
                needs_calib = any(m.needs_calibration for m in recipe) or scheme.static_act
                unit_s = evaluate_windows({"fp32": base}, unit_windows, progress=False)["fp32"]["eval_s"]
                start = time.perf_counter()
                model = lq.quantize(copy.deepcopy(base), recipe, scheme, calib=calib[:count] if needs_calib else None)
                seconds = time.perf_counter() - start
                folder = lq.save(model, Path(scratch) / label.replace(" ", "_").replace(":", "_"))
                del model
                models[label], _ = lq.load(folder)
                rows[label] = {"method": label.split(":", 1)[1].removesuffix(f" n={count}"), "scheme": scheme_name,
                               "calib_samples": count if needs_calib else 0, "quantize_s": seconds,
                               "quantize_units": seconds / unit_s, "unit_eval_s": unit_s,
                               "checkpoint_mb": checkpoint_bytes(folder) / 2**20,
                               "bits_per_weight": bits_per_weight(models[label]), "peak_rss_mb": peak_rss_mb()}
                print(f"{label} {scheme_name}: {seconds:.1f} s ({seconds / unit_s:.1f} units)", flush=True)
    metrics = evaluate_windows(models, windows, reference="fp32")
    table = [rows[name] | m | {"top1_pct": 100 * m["top1"]} for name, m in metrics.items()]
    protocol = windows.protocol | {"calib_source": source.description, "calib_sha256": source.sha256,
                                   "calib_samples": counts, "calib_seqlen": 512}
    write_records(args.out, Record.new("compare", "smollm2-135m", {"rows": table}, protocol))
    print(markdown_table(table, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
