"""Kernel micro-benchmark: each CPU integer kernel against the fp32 matmul on SmolLM2's layer shapes.

    python benchmarks/kernel_speed.py [--out benchmarks/results/kernel_speed.json]

Times are medians of repeated calls in one process; ratios (fp32 time / kernel time) are what to compare. Each
scheme is timed with the kernel the registry measured fastest for that row count and with its integer kernel. Also
times the PyTorch weight-only operators with fp32 activations, to show why our kernels feed them bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from llmeasyquant import QuantLinear, parse_scheme
from llmeasyquant.record import Record, write_records

SHAPES = ((576, 1536), (1536, 576), (576, 576))  # (in, out): gate/up, down, q/o projections of SmolLM2
TOKENS = (1, 128, 512)
SCHEMES = ("w8a8", "w8a16", "w4a16-g64-asym", "w4a16-g128-asym", "w4a8-g64-asym")


def median_ms(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel_speed.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for in_f, out_f in SHAPES:
        weight = torch.randn(out_f, in_f) * 0.05
        for tokens in TOKENS:
            x = torch.randn(tokens, in_f)
            fp32 = median_ms(lambda x=x, w=weight: x @ w.t())
            for name in SCHEMES:
                layer = QuantLinear.from_weight(weight, None, parse_scheme(name))
                ms = median_ms(lambda x=x, layer=layer: layer(x))
                chosen = layer.kernel(tokens).name
                os.environ["LLMEASYQUANT_KERNEL_CHOICE"] = "first"  # the integer kernel, whatever was measured
                layer.forget_kernel()
                integer_ms = median_ms(lambda x=x, layer=layer: layer(x))
                integer = layer.kernel(tokens).name
                del os.environ["LLMEASYQUANT_KERNEL_CHOICE"]
                rows.append({"in": in_f, "out": out_f, "tokens": tokens, "scheme": name, "kernel": chosen, "ms": ms,
                             "fp32_ms": fp32, "speedup": fp32 / ms, "integer_kernel": integer,
                             "integer_kernel_ms": integer_ms, "integer_kernel_speedup": fp32 / integer_ms})
                print(f"{in_f:5d}x{out_f:<5d} M={tokens:<4d} {name:16s} {chosen:20s} {ms:8.3f} ms  fp32 {fp32:8.3f} "
                      f"ms  x{fp32 / ms:5.2f}  ({integer}: x{fp32 / integer_ms:5.2f})")
            codes = torch.randint(-127, 127, (out_f, in_f), dtype=torch.int8)
            ones = torch.ones(out_f)
            fp32_act = median_ms(lambda x=x, c=codes, s=ones: torch.ops.aten._weight_int8pack_mm(x, c, s), 5)
            x16, ones16 = x.bfloat16(), ones.bfloat16()
            bf16_act = median_ms(lambda x=x16, c=codes, s=ones16: torch.ops.aten._weight_int8pack_mm(x, c, s), 5)
            rows.append({"in": in_f, "out": out_f, "tokens": tokens, "scheme": "int8pack_mm operator",
                         "fp32_activations_ms": fp32_act, "bf16_activations_ms": bf16_act, "fp32_ms": fp32})
            print(f"{'':12s} M={tokens:<4d} _weight_int8pack_mm: fp32 inputs {fp32_act:8.3f} ms, "
                  f"bf16 inputs {bf16_act:8.3f} ms")
    protocol = {"threads": torch.get_num_threads(), "repeat": 20, "statistic": "median", "seed": 0}
    write_records(args.out, Record.new("bench", "synthetic SmolLM2 layer shapes", {"rows": rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
