"""Every W4A16 kernel the registry offers, timed on SmolLM2-135M's W4A16 layers (fused q/k/v, o, fused gate/up,
down, the LM head) at a batch's row counts: what the measured choice weighs for a serving step of several sequences
or a prompt chunk.

    python benchmarks/w4a16_batch_kernels.py CHECKPOINT [--rows 4,16,64,512] [--threads 2] [--repeats 9]
        [--out benchmarks/results/w4a16_batch_kernels.json]

CHECKPOINT: a W4A16 checkpoint (e.g. `llmeasyquant quantize smollm2-135m --bits 4 --group-size 32 --lm-head
w4a16-g32`), loaded as `serve` loads it (layers that share an input fused, weights on 2 MiB pages). Each kernel
runs each distinct layer shape on the same random rows: one warm-up call (which prepares it), then the median over
`--repeats` batches of 10 calls. A shape's GFLOP/s is 2 x rows x in x out over that median; a step's total weighs
each shape by how many times a step runs it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from engine_vs_llama import loaded
from llmeasyquant.kernels import candidates
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.record import Record, write_records
from scale_speed import machine


def distinct_layers(model: torch.nn.Module) -> tuple[dict, Counter]:
    """One layer per (in, out) shape, as a step runs them (fused members once, through their combined layer), and how
    many of each a step runs."""
    layers, counts = {}, Counter()
    for module in model.modules():
        if not isinstance(module, QuantLinear):
            continue
        layer = module.shared[0].combined if module.shared is not None else module
        if module.shared is not None and module.shared[1] != 0:  # a fused group counted once, at its first member
            continue
        shape = (layer.in_features, layer.out_features)
        layers.setdefault(shape, layer)
        counts[shape] += 1
    return layers, counts


def median_ms(kernel, layer, x: torch.Tensor, repeats: int) -> float:
    prepared = layer.prepared_for(kernel)
    kernel.run(layer, x, prepared)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            kernel.run(layer, x, prepared)
        times.append((time.perf_counter() - start) / 10)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--rows", default="4,16,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/w4a16_batch_kernels.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = loaded(args.checkpoint)
    layers, counts = distinct_layers(model)
    records = []
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            per_shape, step = {}, Counter()
            for shape, layer in layers.items():
                x = torch.randn(rows, shape[0], generator=torch.Generator().manual_seed(rows))
                found = {kernel.name: median_ms(kernel, layer, x, args.repeats) for kernel in candidates(layer)}
                flop = 2 * rows * shape[0] * shape[1]
                per_shape[f"{shape[0]}x{shape[1]}"] = {
                    name: {"ms": ms, "gflop_s": flop / ms / 1e6} for name, ms in found.items()}
                for name, ms in found.items():
                    step[name] += ms * counts[shape]
                print(f"{rows:4d} rows {shape[0]}x{shape[1]} (x{counts[shape]}): " + ", ".join(
                    f"{name} {ms:.3f} ms" for name, ms in sorted(found.items(), key=lambda item: item[1])), flush=True)
            print(f"{rows:4d} rows, a step's layers: " + ", ".join(
                f"{name} {ms:.1f} ms" for name, ms in sorted(step.items(), key=lambda item: item[1])), flush=True)
            metrics = {"rows": rows, "shapes": per_shape, "step_ms": dict(step),
                       "runs_per_step": {f"{i}x{o}": n for (i, o), n in counts.items()}}
            command = "python benchmarks/w4a16_batch_kernels.py " + " ".join(
                Path(a).name if a.startswith("/") else a for a in (argv if argv is not None else sys.argv[1:]))
            records.append(Record.new("w4a16_batch_kernels", args.checkpoint.name, metrics,
                                      {"threads": args.threads, "repeats": args.repeats, "machine": machine()},
                                      command))
    write_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
