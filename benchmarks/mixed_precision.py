"""Mixed-precision search on SmolLM2-135M against uniform bit widths, with the same quantizer (GPTQ).

    python benchmarks/mixed_precision.py [--budgets 3.0,3.5,4.0,4.5,5.0,5.5] [--uniform 2,3,4,8] [--max-windows 40]
        [--sensitivity kl] [--group-size 64] [--method gptq] [--candidates 2,3,4,8] [--tag NAME]
        [--out benchmarks/results/mixed_precision.json]

`--candidates` and `--uniform` take bit widths (asymmetric, `--group-size`) or scheme names (w3a16-g64-asym,
w4a16-g64-learned, ...); `--method rotate+gptq` measures and quantizes the rotated model. `--tag` names the plan
files and figures of a run (plan_TAG3.5bits.json) so that one run does not replace another's.

Protocol: calibration on the first 64 consecutive 512-token chunks of WikiText-2 validation (shipped); the
sensitivities are measured once (timed: the search's cost) and every budget is allocated from them. Each plan and
each uniform scheme is quantized with the recipe (GPTQ act-order by default) on the same calibration,
saved, and evaluated on WikiText-2 raw test, windows of 512 tokens without BOS, the first `max_windows`, against
the fp32 model on the same windows. Sizes: stored bits per quantized weight (scales and zero points included) and
the bytes of the saved model.safetensors against the model's weights in fp16.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids, load_text
from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
from llmeasyquant.export.checkpoint import WEIGHTS_FILE, bits_per_weight
from llmeasyquant.jobs.compare import float_bytes
from llmeasyquant.methods import recipe_by_name
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.plots import plot_bits_per_layer, plot_size_quality
from llmeasyquant.report.tables import markdown_table
from llmeasyquant.scheme import PerGroup, QuantScheme, parse_scheme

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (("model", "name", ""), ("bits/w", "bits_per_weight", ".3f"), ("MB", "tensor_mb", ".2f"),
           ("fp16 / size", "fp16_ratio", ".2f"), ("ppl", "ppl", ".3f"), ("Δppl %", "ppl_delta_pct", "+.2f"),
           ("KL", "kld", ".4f"), ("top-1 %", "top1_pct", ".2f"), ("quant s", "quantize_s", ".0f"))


def quantize_and_measure(base: torch.nn.Module, method: str, plan: lq.Plan | QuantScheme, calib: torch.Tensor,
                         tokenizer: object) -> tuple[torch.nn.Module, dict]:
    model = lq.quantize(copy.deepcopy(base), recipe_by_name(method), plan, calib=calib)
    with tempfile.TemporaryDirectory() as scratch:
        folder = lq.save(model, Path(scratch) / "ckpt", tokenizer)
        tensor_bytes = (folder / WEIGHTS_FILE).stat().st_size
    return model, {"bits_per_weight": bits_per_weight(model), "tensor_bytes": tensor_bytes,
                   "quantize_s": model.llmeasyquant.quantize_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", default="3.0,3.5,4.0,4.5,5.0,5.5")
    parser.add_argument("--uniform", default="2,3,4,8")
    parser.add_argument("--max-windows", type=int, default=40)
    parser.add_argument("--sensitivity", default="kl")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--candidates", default="2,3,4,8")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/mixed_precision.json")
    parser.add_argument("--figures", type=Path, default=ROOT / "docs/figures")
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    def schemes(text: str) -> list[QuantScheme]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        return [QuantScheme(int(p), False, PerGroup(args.group_size)) if p.isdigit() else parse_scheme(p)
                for p in parts]

    uniform, candidates = schemes(args.uniform), [s.name for s in schemes(args.candidates)]

    base, tokenizer = lq.load_model("smollm2-135m")
    calib, source = calibration_ids("wikitext2", base, tokenizer, args.calib_samples, 512)
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    search = lq.MixedPrecisionSearch(group_size=args.group_size, sensitivity=args.sensitivity, method=args.method,
                                     candidate_schemes=tuple(candidates))
    start = time.perf_counter()
    sens = search.measure(base, calib)  # timed alone, first, on an idle machine
    print(f"sensitivities measured in {time.perf_counter() - start:.1f} s", flush=True)

    plans = {b: search.allocate(sens, lq.Budget(avg_bits=b)) for b in budgets}
    models, rows = {}, {}
    for scheme in uniform:
        # the default asymmetric widths keep their old names ("uniform 4-bit"), named schemes are named
        name = f"uniform {scheme.bits}-bit" if scheme == QuantScheme(scheme.bits, False, PerGroup(args.group_size)) \
            else f"uniform {scheme.name}"
        models[name], rows[name] = quantize_and_measure(base, args.method, scheme, calib, tokenizer)
        rows[name] |= {"kind": "uniform", "bits": scheme.bits, "scheme": scheme.name}
    for budget, result in plans.items():
        name = f"searched {budget:g} bits"
        models[name], rows[name] = quantize_and_measure(base, args.method, result.plan, calib, tokenizer)
        rows[name] |= {"kind": "searched", "budget_avg_bits": budget, "predicted": result.predicted,
                       "bits_histogram": result.bits_histogram(), "scheme_histogram": result.scheme_histogram()}
        result.save(args.out.with_name(f"plan_{args.tag}{budget:g}bits.json"), force=True)
    metrics = evaluate_windows({"fp32": base, **models}, windows, reference="fp32")

    fp16_bytes = float_bytes(base, 2)
    base_ppl = metrics["fp32"]["ppl"]
    table = [{"name": "fp32", "ppl": base_ppl, "fp16_ratio": 0.5, "tensor_mb": 2 * fp16_bytes / 2**20}]
    for name, row in rows.items():
        m = metrics[name]
        row |= m | {"name": name, "tensor_mb": row["tensor_bytes"] / 2**20,
                    "fp16_ratio": fp16_bytes / row["tensor_bytes"], "ppl_delta_pct": 100 * (m["ppl"] / base_ppl - 1),
                    "top1_pct": 100 * m["top1"]}
        table.append(row)
    print(markdown_table(table, COLUMNS))

    checks = {}
    u3, u4 = rows.get("uniform 3-bit"), rows.get("uniform 4-bit")
    if u3 and u4 and 3.5 in plans:
        midpoint = (u3["ppl"] + u4["ppl"]) / 2
        checks["3.5_below_midpoint"] = {"ppl": rows["searched 3.5 bits"]["ppl"], "midpoint": midpoint,
                                        "met": rows["searched 3.5 bits"]["ppl"] < midpoint,
                                        "bits_per_weight": rows["searched 3.5 bits"]["bits_per_weight"]}
    if u4 and 4.5 in plans:
        checks["4.5_below_uniform_4"] = {"ppl": rows["searched 4.5 bits"]["ppl"], "uniform_4": u4["ppl"],
                                         "met": rows["searched 4.5 bits"]["ppl"] < u4["ppl"],
                                         "bits_per_weight": rows["searched 4.5 bits"]["bits_per_weight"]}
    within = [r for r in rows.values() if r["ppl"] <= 1.05 * base_ppl]
    if within:
        smallest = min(within, key=lambda r: r["tensor_bytes"])
        checks["smallest_within_5pct"] = {"name": smallest["name"], "fp16_ratio": smallest["fp16_ratio"],
                                          "ppl": smallest["ppl"], "ppl_delta_pct": smallest["ppl_delta_pct"]}
    print(checks)

    protocol = windows.protocol | {"max_windows": args.max_windows, "method": args.method,
                                   "group_size": args.group_size, "calib_source": source.description,
                                   "calib_sha256": source.sha256, "calib_samples": int(calib.shape[0]),
                                   "calib_seqlen": 512, "threads": torch.get_num_threads(),
                                   "search": {"sensitivity": args.sensitivity, "candidates": candidates,
                                              "probe_samples": search.probe_samples,
                                              "probe_tokens": search.probe_tokens}}
    results = {"search_s": sens.measure_s, "fp32_ppl": base_ppl, "fp16_bytes": fp16_bytes, "rows": table,
               "checks": checks}
    write_records(args.out, Record.new("mixed_precision", "smollm2-135m", results, protocol))
    label = f"SmolLM2-135M, {args.method}, WikiText-2 test, {args.max_windows} x 512 tokens"
    series = {kind: [(r["tensor_mb"], r["ppl"]) for r in rows.values() if r["kind"] == kind]
              for kind in ("uniform", "searched")}
    tag = f"_{args.tag.strip('_')}" if args.tag else ""
    plot_size_quality(series, args.figures / f"mixed_precision_pareto{tag}.png", label, reference=base_ppl,
                      xlabel="model.safetensors MB")
    if 3.5 in plans:
        plot_bits_per_layer(plans[3.5], args.figures / f"mixed_precision_bits{tag}_3.5.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
