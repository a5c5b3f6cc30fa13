"""Where a serving engine's decode step goes: the native blocks, the LM head, the rest of the forward (embedding, the
rows' positions and rotary rows, Python), and the engine around it (admission, token choice, detokenization,
events), at batch 1 and batch 16, in-process on `Engine.load` (the path `serve` runs).

    python benchmarks/engine_overhead.py CHECKPOINT [--batches 1,16] [--prompt-tokens 128] [--new-tokens 128]
        [--threads 2] [--rounds 3] [--out benchmarks/results/engine_overhead.json]

Each round submits `batch` greedy requests of `--prompt-tokens` WikiText-2 tokens (different windows) and
`--new-tokens` tokens each, all at once, and reads their streams to the end. Every forward of the engine is timed
from its start to the next forward's start (the step), and within it the native call (StepProgram.run) and the LM
head; steps that carry prompt rows are left out, so the figures are of decode steps with all `batch` sequences
running. Medians over the steps of each round, then over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmeasyquant.calibration.data import load_text, tokenize
from llmeasyquant.record import Record, write_records
from llmeasyquant.runtime.engine import Engine, EngineConfig
from llmeasyquant.runtime.requests import SamplingParams
from scale_speed import machine


@dataclass
class Timings:
    """Per forward: its start, its rows, and seconds in the native call and in the head."""

    starts: list[float]
    rows: list[int]
    native: list[float]
    head: list[float]


class TimedProgram:
    """A StepProgram whose run() adds its seconds to the current forward's."""

    def __init__(self, program: object, timings: Timings) -> None:
        self.program, self.timings = program, timings

    def run(self, *args) -> object:
        start = time.perf_counter()
        found = self.program.run(*args)
        self.timings.native[-1] += time.perf_counter() - start
        return found


def instrument(engine: Engine) -> Timings:
    """Wrap the engine's forward, native steps and LM head with timers (they run on the engine's thread)."""
    timings = Timings([], [], [], [])
    decoder, parts = engine.decoder, engine.decoder.parts
    forward, native_step, head = decoder.forward, decoder.native_step, parts.lm_head

    def timed_forward(ids, rows, wanted):
        timings.starts.append(time.perf_counter())
        timings.rows.append(int(ids.shape[0]))
        timings.native.append(0.0)
        timings.head.append(0.0)
        return forward(ids, rows, wanted)

    def timed_native_step(rows):
        step = native_step(rows)
        if step is None:
            return None
        return type(step)(TimedProgram(step.program, timings), step.runs)

    def timed_head(x):
        start = time.perf_counter()
        found = head(x)
        timings.head[-1] += time.perf_counter() - start
        return found

    decoder.forward, decoder.native_step, parts.lm_head = timed_forward, timed_native_step, timed_head
    return timings


def one_round(engine: Engine, timings: Timings, prompts: list[list[int]], new_tokens: int) -> dict | None:
    """The round's medians, or None when no step had every sequence decoding (too few tokens for the batch)."""
    first = len(timings.starts)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    streams = [engine.submit(prompt, params) for prompt in prompts]
    for stream in streams:
        for _ in stream:
            pass
    engine.submit(prompts[0][:4], SamplingParams(max_tokens=1, temperature=0.0))  # one more forward: an end time
    time.sleep(0.5)
    batch = len(prompts)
    steps = [i for i in range(first, len(timings.starts) - 1) if timings.rows[i] == batch]
    if not steps:
        return None
    step = [timings.starts[i + 1] - timings.starts[i] for i in steps]
    native = [timings.native[i] for i in steps]
    head = [timings.head[i] for i in steps]
    median = statistics.median
    total = median(step)
    return {"step_ms": 1000 * total, "native_ms": 1000 * median(native), "head_ms": 1000 * median(head),
            "other_ms": 1000 * (total - median(native) - median(head)), "steps": len(steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_overhead.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.load(str(args.checkpoint), EngineConfig(kv_memory_mb=256, max_running=max(batches)))
    ids = tokenize(engine.tokenizer, load_text("wikitext2").text).tolist()
    timings = instrument(engine)
    records = []
    try:
        one_round(engine, timings, [ids[:args.prompt_tokens]], 8)  # warm-up: kernels chosen, programs built
        for batch in batches:
            prompts = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(batch)]
            one_round(engine, timings, prompts, 8)
            rounds = [one_round(engine, timings, prompts, args.new_tokens) for _ in range(args.rounds)]
            if None in rounds:
                raise SystemExit(f"no step had all {batch} sequences decoding: ask for more --new-tokens")
            metrics = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} | {
                "batch": batch, "rounds": rounds}
            metrics["outside_native_share"] = 1 - (metrics["native_ms"] + metrics["head_ms"]) / metrics["step_ms"]
            print(f"batch {batch}: step {metrics['step_ms']:.2f} ms = native blocks {metrics['native_ms']:.2f} + "
                  f"head {metrics['head_ms']:.2f} + the rest {metrics['other_ms']:.2f} "
                  f"({100 * metrics['outside_native_share']:.1f}% outside the native calls)", flush=True)
            command = "python benchmarks/engine_overhead.py " + " ".join(
                Path(a).name if a.startswith("/") else a for a in (argv if argv is not None else sys.argv[1:]))
            records.append(Record.new("engine_overhead", args.checkpoint.name, metrics,
                                      {"threads": args.threads, "prompt_tokens": args.prompt_tokens,
                                       "new_tokens": args.new_tokens, "kv_cache": "float16", "machine": machine()},
                                      command))
    finally:
        engine.shutdown(grace_s=5)
    write_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
