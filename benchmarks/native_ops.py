"""The fused C++ operators (kernels/native.py) against the PyTorch operators they replace, on SmolLM2's shapes.

    python benchmarks/native_ops.py [--threads 1,2] [--out benchmarks/results/native_ops.json]

For a 512-token prompt: causal attention (9 query heads, 3 kv heads, 64 wide) against SDPA, and W8A8's activation
quantization and epilogue against the PyTorch operators (bit for bit the same results). For W4A16 (g64, asymmetric)
at 1, 16, 128 and 512 rows: the fused-operator kernel against PyTorch's int4 operator and the reference
(dequantize, then fp32 GEMM). Medians of repeated calls in one process; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kernel_speed import median_ms  # benchmarks/ is the script's own folder, first on the path
from llmeasyquant import QuantLinear, parse_scheme
from llmeasyquant.kernels import ALL_KERNELS, native
from llmeasyquant.kernels.cpu import quantize_rows_symmetric
from llmeasyquant.primitives import MIN_SCALE
from llmeasyquant.record import Record, write_records

PROMPT, HEADS, KV_HEADS, HEAD_DIM = 512, 9, 3, 64
LINEAR_SHAPES = ((576, 960), (576, 3072), (1536, 576))  # (in, out): fused q/k/v, fused gate/up, down
W4_ROWS = (1, 16, 128, 512)
W4_KERNELS = ("cpu_native_w4a16", "cpu_int4pack_w4a16", "reference")


def prompt_operators(ops) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(PROMPT, HEADS, HEAD_DIM, generator=gen)
    keys, values = (torch.randn(KV_HEADS, PROMPT, HEAD_DIM, generator=gen) for _ in range(2))
    scale = HEAD_DIM**-0.5
    rows = [{"operator": "causal_attention", "shape": f"{PROMPT} tokens, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}",
             "fused_ms": median_ms(lambda: ops.causal_attention(queries, keys, values, 0, scale)),
             "pytorch_ms": median_ms(lambda: F.scaled_dot_product_attention(
                 queries.transpose(0, 1)[None], keys[None], values[None], is_causal=True, scale=scale,
                 enable_gqa=True))}]
    for width in (576, 1536):
        x = torch.randn(PROMPT, width, generator=gen)
        rows.append({"operator": "quantize_rows", "shape": f"{PROMPT} x {width}",
                     "fused_ms": median_ms(lambda x=x: ops.quantize_rows(x, MIN_SCALE)),
                     "pytorch_ms": median_ms(lambda x=x: quantize_rows_symmetric(x))})
    acc = torch.randint(-2**20, 2**20, (PROMPT, 960), dtype=torch.int32, generator=gen)
    row_scales, column_scales = torch.rand(PROMPT, 1, generator=gen), torch.rand(960, generator=gen)
    rows.append({"operator": "dequantize_rows", "shape": f"{PROMPT} x 960",
                 "fused_ms": median_ms(lambda: ops.dequantize_rows(acc, row_scales, column_scales)),
                 "pytorch_ms": median_ms(lambda: torch.mul(acc, row_scales) * column_scales)})
    for row in rows:
        row["speedup"] = row["pytorch_ms"] / row["fused_ms"]
    return rows


def w4a16_kernels() -> list[dict]:
    rows = []
    for in_f, out_f in LINEAR_SHAPES:
        weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(in_f + out_f)) * 0.05
        layer = QuantLinear.from_weight(weight, None, parse_scheme("w4a16-g64-asym"))
        for tokens in W4_ROWS:
            x = torch.randn(tokens, in_f)
            row = {"in": in_f, "out": out_f, "tokens": tokens}
            for name in W4_KERNELS:
                kernel = ALL_KERNELS[name]
                prepared = layer.prepared_for(kernel)
                row[f"{name}_ms"] = median_ms(lambda k=kernel, p=prepared, x=x, layer=layer: k.run(layer, x, p))
            rows.append(row)
    return rows


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts, measured in turn")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/native_ops.json"))
    args = parser.parse_args()
    ops = native.ops()
    if ops is None:
        print("the fused operators are not built here (see the log); nothing to measure", file=sys.stderr)
        return 1
    results = {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        results[threads] = {"prompt_operators": prompt_operators(ops), "w4a16": w4a16_kernels()}
        for row in results[threads]["prompt_operators"]:
            print(f"{threads} thr  {row['operator']:18s} {row['shape']:32s} fused {row['fused_ms']:7.3f} ms  "
                  f"PyTorch {row['pytorch_ms']:7.3f} ms  x{row['speedup']:.2f}")
        for row in results[threads]["w4a16"]:
            times = "  ".join(f"{name} {row[name + '_ms']:7.3f}" for name in W4_KERNELS)
            print(f"{threads} thr  w4a16-g64-asym {row['in']}x{row['out']} at {row['tokens']:3d} rows (ms): {times}")
    protocol = {"prompt_tokens": PROMPT, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                "w4a16_scheme": "w4a16-g64-asym", "repeats": 20, "statistic": "median"}
    write_records(args.out, Record.new("kernels", "smollm2-135m shapes", {str(k): v for k, v in results.items()},
                                       protocol))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
