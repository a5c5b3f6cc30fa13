"""The paged attention operators alone: one decode row over the float32, float16 and 4-bit KV pools.

    python benchmarks/paged_attention.py [--positions 2048] [--threads 1,2] [--rounds 15]
        [--out benchmarks/results/paged_attention.json]

Protocol: SmolLM2's attention shape (9 query heads over 3 kv heads of 64 values), blocks of 32 positions, one
query row attending over `positions` positions; random pool contents (speed does not depend on the values), block
tables in random order as a running pool hands them out. "in cache": one sequence, its pool read again and again;
"from memory": 64 sequences read in turn (their pools, some 100 MB, do not fit in the caches). Each variant is
timed over 64 calls once per round, the variants interleaved; the median over rounds is kept.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from llmeasyquant.kernels import native
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

HEADS, KV_HEADS, DIM, BLOCK, SINKS, OUTLIERS = 9, 3, 64, 32, 8, 1
COLUMNS = (("threads", "threads", "d"), ("reads", "reads", ""), ("pool", "pool", ""), ("µs", "us", ".1f"),
           ("× fp16", "ratio", ".2f"))


def quant_pool(blocks: int, sequences: int, bits: int = 4) -> list[torch.Tensor]:
    """Random tensors in the layout of runtime/paged_reference.py's QUANT_POOL."""
    packed = DIM // 8 * bits
    u8 = torch.uint8
    return [torch.randint(0, 256, (blocks, KV_HEADS, BLOCK, packed), dtype=u8),
            torch.randn(blocks, KV_HEADS, DIM).half(), (torch.rand(blocks, KV_HEADS, DIM) * 0.1).half(),
            torch.randint(0, 256, (blocks, KV_HEADS, BLOCK, packed), dtype=u8),
            (torch.rand(blocks, KV_HEADS, BLOCK) * 0.1).half(),
            torch.randint(0, 240, (blocks, KV_HEADS, BLOCK), dtype=u8),
            torch.randn(blocks, KV_HEADS, BLOCK, OUTLIERS).half(),
            torch.randint(0, DIM, (blocks, KV_HEADS, BLOCK, OUTLIERS), dtype=u8),
            torch.randn(sequences, KV_HEADS, SINKS, DIM).half(), torch.randn(sequences, KV_HEADS, SINKS, DIM).half(),
            torch.randn(sequences, KV_HEADS, BLOCK, DIM).half()]


def timings(positions: int, sequences: int, rounds: int) -> dict[str, float]:
    ops = native.ops()
    per_sequence = positions // BLOCK
    blocks = sequences * per_sequence
    tables = torch.randperm(blocks).to(torch.int32).reshape(sequences, per_sequence)
    keys, values = torch.randn(blocks, KV_HEADS, BLOCK, DIM), torch.randn(blocks, KV_HEADS, BLOCK, DIM)
    halves = keys.half(), values.half()
    pool = quant_pool(blocks, sequences)
    cos, sin = torch.randn(positions, DIM), torch.randn(positions, DIM)
    q, lengths, scale = torch.randn(1, HEADS, DIM), torch.tensor([positions]), DIM**-0.5
    rows = [torch.tensor([i]) for i in range(sequences)]
    variants = {
        "float32": lambda i: ops.paged_attention(q, keys, values, tables, rows[i], lengths, scale),
        "float16": lambda i: ops.paged_attention(q, *halves, tables, rows[i], lengths, scale),
        "4-bit": lambda i: ops.quant_attention(q, pool, tables, rows[i], lengths, cos, sin, 4, SINKS, scale),
    }
    found: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            call(0)
            start = time.perf_counter()
            for i in range(64):
                call(i % sequences)
            found[name].append(1e6 * (time.perf_counter() - start) / 64)
    return {name: statistics.median(times) for name, times in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/paged_attention.json")
    args = parser.parse_args()
    if native.ops() is None or not hasattr(native.ops(), "quant_attention"):
        parser.error("the native operators could not be built here (see the log)")
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for reads, sequences in (("in cache", 1), ("from memory", 64)):
            found = timings(args.positions, sequences, args.rounds)
            rows += [{"threads": threads, "reads": reads, "pool": pool, "us": us, "ratio": us / found["float16"]}
                     for pool, us in found.items()]
    print(markdown_table(rows, COLUMNS))
    protocol = {"positions": args.positions, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK,
                "sinks": SINKS, "value_outliers": OUTLIERS, "rounds": args.rounds, "calls_per_round": 64,
                "statistic": "median over rounds of the mean over 64 calls"}
    command = " ".join(["python", "benchmarks/paged_attention.py", *sys.argv[1:]])
    write_records(args.out, [Record.new("paged_attention", f"{r['pool']} pool", r, protocol, command) for r in rows])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
