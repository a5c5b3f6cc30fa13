"""The W4A16 decode kernel's two paths, layer by layer, at SmolLM2-135M, Llama-3.2-1B and Llama-3-8B shapes.

    python benchmarks/w4a16_decode_paths.py [--threads 1,2] [--rounds 7] [--calls 10]
        [--out benchmarks/results/w4a16_decode_paths.json]

`int4_weight_matmul` (kernels/native/matmul_kernels.cpp) decodes int4 codes in registers for a few rows of
activations either through a 16-entry fp32 table per group (fp32 activations) or, on CPUs with AVX-512 BF16, as
exact bf16 integers multiplied by bf16 dot products with the activations split into two bf16 numbers. Both paths
run on the same random weights (W4A16 g128, symmetric: what `scale_speed.py` measures) in interleaved rounds in one
process; each round times `--calls` calls of each path, and the figure is the best round's mean (the least
disturbed by other work on a shared machine). Reported: milliseconds, GB/s of codes and scales read, and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

from llmeasyquant import QuantLinear, parse_scheme
from llmeasyquant.kernels import native
from llmeasyquant.record import Record, write_records

# (model, layer, in, out): the linears of a decoder block, q/k/v and gate/up fused as `bench` runs them.
SHAPES = (
    ("smollm2-135m", "qkv", 576, 960), ("smollm2-135m", "o", 576, 576), ("smollm2-135m", "k", 576, 192),
    ("smollm2-135m", "gate_up", 576, 3072), ("smollm2-135m", "down", 1536, 576),
    ("llama-3.2-1b", "qkv", 2048, 3072), ("llama-3.2-1b", "o", 2048, 2048),
    ("llama-3.2-1b", "gate_up", 2048, 16384), ("llama-3.2-1b", "down", 8192, 2048),
    ("llama-3-8b", "qkv", 4096, 6144), ("llama-3-8b", "o", 4096, 4096),
    ("llama-3-8b", "gate_up", 4096, 28672), ("llama-3-8b", "down", 14336, 4096),
)
SCHEME = "w4a16-g128"
PATHS = {"table_fp32": False, "bf16_dot": True}


def best_round_ms(calls: dict, rounds: int, per_round: int) -> dict[str, float]:
    """Interleaved rounds of each callable; the best round's mean per call, in ms."""
    best = {name: float("inf") for name in calls}
    for fn in calls.values():
        fn()  # warm: caches, threads
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            best[name] = min(best[name], 1000 * (time.perf_counter() - start) / per_round)
    return best


@torch.no_grad()
def measure(shapes, threads: list[int], rows: list[int], rounds: int, per_round: int) -> list[dict]:
    ops = native.ops()
    if ops is None:
        raise SystemExit("the native operators are not built here (see the log); nothing to compare")
    results = []
    for model, name, in_f, out_f in shapes:
        layer = QuantLinear.from_weight(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)) * 0.02,
                                        None, parse_scheme(SCHEME))
        scales = layer.scales.float().contiguous()
        read = layer.qweight.numel() + scales.numel() * 4  # what a call reads: codes, fp32 scales
        for count in rows:
            x = torch.randn(count, in_f, generator=torch.Generator().manual_seed(1))
            for thread_count in threads:
                torch.set_num_threads(thread_count)
                calls = {path: functools.partial(ops.int4_weight_matmul, x, layer.qweight, scales, None,
                                                 layer.group_size, flag) for path, flag in PATHS.items()}
                ms = best_round_ms(calls, rounds, per_round)
                row = {"model": model, "layer": name, "in": in_f, "out": out_f, "rows": count,
                       "threads": thread_count, **{f"{p}_ms": ms[p] for p in PATHS},
                       **{f"{p}_gbs": read / ms[p] / 1e6 for p in PATHS},
                       "speedup": ms["table_fp32"] / ms["bf16_dot"]}
                results.append(row)
                print(f"{model:13s} {name:8s} {in_f:5d}x{out_f:<5d} rows {count} threads {thread_count}: "
                      f"table {ms['table_fp32']:.3f} ms ({row['table_fp32_gbs']:.1f} GB/s)  bf16 dot "
                      f"{ms['bf16_dot']:.3f} ms ({row['bf16_dot_gbs']:.1f} GB/s)  x{row['speedup']:.2f}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rows", default="1,4", help="comma-separated rows of activations (decode batch sizes)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="calls per path per round")
    parser.add_argument("--models", default="llama-3.2-1b,llama-3-8b",
                        help="which models' shapes (smollm2-135m, llama-3.2-1b, llama-3-8b)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/w4a16_decode_paths.json"))
    args = parser.parse_args(argv)
    ops = native.ops()
    if ops is not None and not ops.bf16_dot_built():
        raise SystemExit("this CPU (or build) has no AVX-512 BF16: the bf16 dot path is not built, nothing to compare")
    models = args.models.split(",")
    shapes = [s for s in SHAPES if s[0] in models]
    rows = measure(shapes, [int(t) for t in args.threads.split(",")], [int(r) for r in args.rows.split(",")],
                   args.rounds, args.calls)
    protocol = {"scheme": SCHEME, "rounds": args.rounds, "calls_per_round": args.calls,
                "statistic": "best round's mean", "seed": 0, "weights": "randn x 0.02"}
    write_records(args.out, Record.new("bench", "Llama layer shapes, random weights", {"rows": rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
