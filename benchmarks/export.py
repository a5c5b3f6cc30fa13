"""One quantized model, three runtimes: export SmolLM2-135M checkpoints and check each export in its runtime.

    python benchmarks/export.py [--max-windows 10] [--runs 0,1,...] [--out benchmarks/results/export.json]

Each run quantizes the bundled SmolLM2-135M (calibration: the first 64 consecutive 512-token chunks of WikiText-2
validation, for the methods that need it), saves the checkpoint, exports it, loads the export in its runtime and
evaluates the same windows (WikiText-2 raw test, 512-token windows, no BOS, the first --max-windows) there and
with our reference kernel (the fp32 arithmetic every export follows). A runtime that is not installed is
recorded as skipped. llama.cpp comes from `pip install llama-cpp-python` (it compiles llama.cpp; not in CI).

The baseline row runs the bundled GGUF file itself in llama.cpp against the unquantized model in PyTorch (the same
weights): the gap llama.cpp's own arithmetic makes before any export is involved.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids, load_text
from llmeasyquant.eval.export_check import check_export
from llmeasyquant.eval.perplexity import make_windows
from llmeasyquant.export.checkpoint import checkpoint_bytes
from llmeasyquant.export.formats import export
from llmeasyquant.methods import recipe_by_name
from llmeasyquant.models.load import bundled_gguf
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

RUNS = (  # (recipe, scheme, options, formats the checkpoint is exported to)
    ("smoothquant", "w8a8", {"alpha": 0.8}, ("compressed-tensors", "onnx")),
    ("gptq", "w4a16-g64", {}, ("compressed-tensors", "onnx")),
    ("rtn", "w8a16", {}, ("onnx",)),
    ("rtn", "w8a16-g32", {}, ("gguf",)),
    ("gptq", "w4a16-g32-asym", {}, ("gguf",)),
    ("rtn", "w4a16-g32", {}, ("gguf",)),
)
COLUMNS = (("format", "format", ""), ("method", "method", ""), ("scheme", "scheme", ""),
           ("runtime", "runtime", ""), ("MB", "export_mb", ".1f"), ("export s", "export_s", ".1f"),
           ("load s", "load_s", ".2f"), ("ppl ours", "ppl_ours", ".4f"), ("ppl runtime", "ppl_runtime", ".4f"),
           ("Δppl %", "ppl_rel_diff_pct", "+.3f"), ("max |Δlogit|", "max_abs_logit_diff", ".2e"),
           ("exact layers", "lossless_layers", "d"), ("re-quantized", "requantized", "d"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-windows", type=int, default=10)
    parser.add_argument("--runs", help="comma-separated indexes into RUNS (default: all)")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/export.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    base, tokenizer = lq.load_model("smollm2-135m")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512,
                           args.max_windows)
    windows.protocol.update(threads=torch.get_num_threads(), seed=0)
    calib, source = calibration_ids("wikitext2", base, tokenizer, args.calib_samples, 512)
    indexes = [int(i) for i in args.runs.split(",")] if args.runs else range(len(RUNS))
    baseline = {"format": "gguf", "method": "none (bundled Q4_1 file)", "scheme": "float",
                "export_mb": bundled_gguf().stat().st_size / 1e6} | check_export(bundled_gguf(), "gguf", base, windows)
    rows = [baseline]
    print(markdown_table(rows, COLUMNS), flush=True)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as work:
        for index in indexes:
            recipe_name, scheme_name, options, formats = RUNS[index]
            scheme = lq.parse_scheme(scheme_name)
            recipe = recipe_by_name(recipe_name, **options)
            needs_calib = any(m.needs_calibration for m in recipe) or scheme.static_act
            model = lq.quantize(copy.deepcopy(base), recipe, scheme, calib=calib if needs_calib else None)
            ckpt = lq.save(model, Path(work) / f"ckpt-{index}", tokenizer)
            model, _ = lq.load(ckpt)  # exported and checked as a user would: from the saved checkpoint
            for fmt in formats:
                out = Path(work) / f"{fmt}-{index}" / ("model.gguf" if fmt == "gguf" else "model")
                result = export(model, fmt, out, tokenizer=tokenizer)
                check = check_export(result.path, fmt, model, windows)
                row = {"format": fmt, "method": recipe_name, "scheme": scheme_name, "options": options,
                       "checkpoint_mb": checkpoint_bytes(ckpt) / 1e6, "export_mb": result.bytes / 1e6,
                       "export_s": result.seconds, "lossless_layers": len(result.lossless),
                       "requantized": len(result.requantized), "notes": result.notes} | check
                rows.append(row)
                print(markdown_table([row], COLUMNS), flush=True)
    protocol = windows.protocol | {"calib_source": source.description, "calib_sha256": source.sha256,
                                   "calib_samples": args.calib_samples, "calib_seqlen": 512,
                                   "ours": "reference kernel (fp32)"}
    write_records(args.out, Record.new("export", "smollm2-135m", {"rows": rows}, protocol))
    print(markdown_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
