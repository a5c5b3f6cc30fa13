"""Online activation ranges (EMA, no calibration) against static calibrated and dynamic per-token W8A8.

    python benchmarks/online_activations.py [--max-windows 20] [--out benchmarks/results/online_activations.json]

Protocol: SmolLM2-135M, RTN W8A8 weights (per channel, symmetric), WikiText-2 raw test, 512-token windows, no BOS.
The online models see the windows as one stream: window 1 is their first observation (its perplexity is reported
apart), windows 2..N are scored; every other model is scored on the same windows 2..N. Static scales: the first 64
consecutive 512-token chunks of WikiText-2 validation. KL and top-1 against fp32 on the same windows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids, load_text
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows, make_windows, perplexity
from llmeasyquant.methods import recipe_by_name
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

RUNS = (  # (row name, recipe, scheme, options of make_scheme's online mode)
    ("dynamic per-token", "rtn", "w8a8", {}),
    ("static, calibrated", "rtn", "w8a8-astatic", {}),
    ("online α=0.9", "rtn", "w8a8-aonline", {"momentum": 0.9}),
    ("online α=0.99", "rtn", "w8a8-aonline", {"momentum": 0.99}),
    ("online α=0.5", "rtn", "w8a8-aonline", {"momentum": 0.5}),
    ("online α=0.9, std floor", "rtn", "w8a8-aonline", {"momentum": 0.9, "std_floor": True}),
    ("online α=0.9, asymmetric", "rtn", "w8a8-aonline-aasym", {"momentum": 0.9}),
    ("smoothquant 0.8, static", "smoothquant", "w8a8-astatic", {}),
    ("smoothquant 0.8, online α=0.9", "smoothquant", "w8a8-aonline", {"momentum": 0.9}),
)
COLUMNS = (("activations", "name", ""), ("scheme", "scheme", ""), ("calibration", "calibration", ""),
           ("first window ppl", "first_window_ppl", ".3f"), ("ppl (windows 2..N)", "ppl", ".3f"),
           ("Δ vs static %", "vs_static_pct", "+.2f"), ("KL", "kld", ".5f"), ("top-1 %", "top1_pct", ".2f"))


def scheme_for(name: str, online: dict) -> lq.QuantScheme:
    scheme = lq.parse_scheme(name)
    if not online:
        return scheme
    act = lq.ActScheme(bits=8, symmetric=scheme.act.symmetric, mode=lq.ActMode.ONLINE,
                       granularity=scheme.act.granularity, **online)
    return lq.QuantScheme(scheme.bits, scheme.symmetric, scheme.granularity, act)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-windows", type=int, default=20)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/online_activations.json"))
    args = parser.parse_args()
    base, tokenizer = lq.load_model("smollm2-135m")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    first, scored = (EvalWindows(ids, windows.protocol) for ids in (windows.ids[:1], windows.ids[1:]))
    calib, source = calibration_ids("wikitext2", base, tokenizer, args.calib_samples, 512)
    models, rows = {"fp32": base}, []
    for name, recipe_name, scheme_name, online in RUNS:
        model, _ = lq.load_model("smollm2-135m")
        recipe = recipe_by_name(recipe_name, **({"alpha": 0.8} if recipe_name == "smoothquant" else {}))
        scheme = scheme_for(scheme_name, online)
        needs_calib = scheme.static_act or any(m.needs_calibration for m in recipe)
        start = time.perf_counter()
        lq.quantize(model, recipe, scheme, calib=calib if needs_calib else None)
        row = {"name": name, "method": recipe_name, "scheme": scheme.name, "online": online,
               "calibration": source.description if needs_calib else "none", "quantize_s": time.perf_counter() - start}
        if scheme.act.mode is lq.ActMode.ONLINE:  # the stream's first window: the range starts from nothing
            row["first_window_ppl"] = perplexity(model, first, progress=False)["ppl"]
        models[name], rows = model, [*rows, row]
    results = evaluate_windows(models, scored, reference="fp32")
    static = results["static, calibrated"]["ppl"]
    for row in rows:
        metrics = results[row["name"]]
        row |= {"ppl": metrics["ppl"], "kld": metrics["kld"], "top1_pct": 100 * metrics["top1"],
                "vs_static_pct": 100 * (metrics["ppl"] / static - 1)}
    fp32 = {"name": "fp32", "scheme": "-", "calibration": "-", **results["fp32"]}
    table = markdown_table([fp32, *rows], COLUMNS)
    print(table)
    protocol = {**windows.protocol, "scored_windows": "2..N", "calibration": source.description,
                "calib_samples": args.calib_samples, "weights": "rtn w8 per channel symmetric"}
    write_records(args.out, Record.new("online_activations", "smollm2-135m",
                                       {"rows": rows, "fp32": results["fp32"], "table": table}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
