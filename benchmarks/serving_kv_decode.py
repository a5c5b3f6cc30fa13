"""Decode step time of the serving engine at long context: the float16 KV pool against the SimQuant pools.

    python benchmarks/serving_kv_decode.py [--model smollm2-135m] [--contexts 512,2048] [--caches fp16,4,3,8]
        [--batch 1] [--steps 32] [--rounds 3] [--out benchmarks/results/serving_kv_decode.json]

Protocol: the engine (runtime/engine.py) in-process, 2 threads; `batch` requests whose prompts are consecutive
`context`-token windows of WikiText-2 raw test (shipped) are prefilled, then `steps` greedy tokens are decoded
(end-of-sequence ignored). The time per decode step is the median gap between a request's consecutive events,
pooled over the requests; every cache runs once per round, interleaved, and the median over rounds is kept. The
decode attention of the quantized pools reads the codes in place (kernels/native/paged_ops.cpp). Bytes per token
are the pool's own accounting (runtime/kv_pool.py): blocks, and for the quantized pools each sequence's sinks and
incomplete key block spread over the context.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

from llmeasyquant.calibration.data import load_text, tokenize
from llmeasyquant.models.load import load_model
from llmeasyquant.nn.fused import fuse_shared_inputs
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table
from llmeasyquant.runtime.engine import Engine, EngineConfig
from llmeasyquant.runtime.requests import SamplingParams

COLUMNS = (("context", "context", "d"), ("batch", "batch", "d"), ("cache", "cache", ""),
           ("step ms", "step_ms", ".2f"), ("× fp16 time", "time_ratio", ".2f"),
           ("KV bytes/token", "bytes_per_token", ".0f"), ("fp16 / this", "memory_ratio", ".2f"))


def step_ms(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    streams = [engine.submit(p, params) for p in prompts]
    gaps = []
    for stream in streams:
        times = [event.time_s for event in stream]
        gaps += [b - a for a, b in itertools.pairwise(times)]  # the first event follows the prefill
    return 1e3 * statistics.median(gaps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model spec or checkpoint folder")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--caches", default="fp16,4,3,8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/serving_kv_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from llmeasyquant.export.checkpoint import is_checkpoint, load

    model, tokenizer = load(args.model) if is_checkpoint(args.model) else load_model(args.model)
    fuse_shared_inputs(model)
    ids = tokenize(tokenizer, load_text("wikitext2").text)
    contexts = [int(c) for c in args.contexts.split(",")]
    caches = args.caches.split(",")
    longest = max(contexts) + args.steps + 8
    engines = {}
    for cache in caches:
        bits = None if cache == "fp16" else int(cache)
        engines[cache] = Engine(model, tokenizer, EngineConfig(kv_memory_mb=64 * args.batch * longest / 1024,
                                                               kv_bits=bits, max_context=longest,
                                                               max_running=args.batch), name=cache)
    rows = []
    for context in contexts:
        prompts = [ids[i * context:(i + 1) * context].tolist() for i in range(args.batch)]
        times: dict[str, list[float]] = {cache: [] for cache in caches}
        for _ in range(args.rounds):
            for cache in caches:
                times[cache].append(step_ms(engines[cache], prompts, args.steps))
        for cache in caches:
            pool = engines[cache].pool
            per_token = pool.bytes_for(context) / context
            rows.append({"context": context, "batch": args.batch, "cache": pool.kind,
                         "step_ms": statistics.median(times[cache]), "bytes_per_token": per_token})
        base = next(r for r in rows if r["context"] == context and r["cache"] == "float16")
        for row in rows[-len(caches):]:
            row["time_ratio"] = row["step_ms"] / base["step_ms"]
            row["memory_ratio"] = base["bytes_per_token"] / row["bytes_per_token"]
    for engine in engines.values():
        engine.shutdown(5)
    print(markdown_table(rows, COLUMNS))
    protocol = {"model": args.model, "steps": args.steps, "rounds": args.rounds, "threads": 2, "greedy": True,
                "text": "WikiText-2 raw test (shipped)", "statistic": "median decode step over requests, median "
                "over rounds"}
    command = " ".join(["python", "benchmarks/serving_kv_decode.py", *sys.argv[1:]])
    write_records(args.out, [Record.new("serving_kv_decode", args.model, row, protocol, command) for row in rows])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
