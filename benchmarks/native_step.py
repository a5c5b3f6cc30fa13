"""Decode speed of the engine's forward with its blocks in one native call (runtime/native_step.py) against the same
blocks on the Python forward of runtime/batch.py, in one process.

    python benchmarks/native_step.py CHECKPOINT [CHECKPOINT ...] [--rounds 6] [--threads 2] [--prompt-tokens 32]
        [--new-tokens 16] [--out benchmarks/results/native_step.json]

Per checkpoint: load it (export/checkpoint.load), fuse q/k/v and gate/up, move the weights onto 2 MiB pages (as `bench`
and scale_speed.py do), build one decoder (the engine's forward for one sequence), check that the two ways give the same
logits bit for bit over `--new-tokens` forced steps, then `--rounds` rounds, each timing both ways in a shuffled order
(a prefill of a `--prompt-tokens` prompt of seeded random ids, then `--new-tokens` greedy steps; tokens/s over the
steps). Medians over rounds, and how many rounds each side won: the host is shared and noisy, so the two are compared
within each round. The kernels are the registry's measured choice (as in `bench`); the record says how many blocks
qualified.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from llmeasyquant import fuse_shared_inputs, load
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.runtime.decoder import LeanDecoder
from same_process_ab import parse, parser, run_each, timed_rounds


@torch.no_grad()
def steps(decoder: LeanDecoder, native: bool, prompt: torch.Tensor, new_tokens: int,
          forced: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    """Seconds of `new_tokens` steps after a prefill of `prompt`, and their logits; greedy unless `forced`."""
    decoder.batch.native = native
    decoder.reset()
    token = decoder.prefill(prompt).argmax()
    found = []
    start = time.perf_counter()
    for index in range(new_tokens):
        logits = decoder.step(token if forced is None else forced[index])
        token = logits.argmax()
        found.append(logits)
    return time.perf_counter() - start, torch.stack(found)


def measure(checkpoint: Path, args: argparse.Namespace) -> dict:
    model, _ = load(checkpoint)
    fuse_shared_inputs(model)
    model.eval()
    moved = place_on_huge_pages(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(args.seed))
    decoder = LeanDecoder(model, args.prompt_tokens + args.new_tokens)
    forced = torch.randint(0, model.config.vocab_size, (args.new_tokens,),
                           generator=torch.Generator().manual_seed(args.seed + 1))
    if not torch.equal(steps(decoder, True, prompt, args.new_tokens, forced)[1],
                       steps(decoder, False, prompt, args.new_tokens, forced)[1]):
        raise SystemExit("the native step and the Python forward give different logits")
    decoder.batch.native = True
    qualifying = decoder.batch.native_step(1).native_blocks
    sides = {side: (lambda native=side == "native": args.new_tokens / steps(decoder, native, prompt,
                                                                            args.new_tokens)[0])
             for side in ("native", "python")}
    found = timed_rounds(checkpoint.name, sides, args.rounds, args.seed)
    return {**found, "blocks": len(decoder.blocks), "native_blocks": qualifying, "huge_page_bytes": moved,
            "same_logits": True}


def main(argv: list[str] | None = None) -> int:
    args = parse(parser(__doc__, "benchmarks/results/native_step.json"), argv)
    protocol = {"runtime": "the engine's forward for one sequence (fp32 KV pool), q/k/v and gate/up fused, weights "
                           "on 2 MiB pages, kernels measured",
                "compared": "one decoder, its blocks in one native call or on the Python forward; both timed in "
                            "every round, in a shuffled order"}
    return run_each(args, "native_step.py", "native_step", protocol, measure,
                    lambda row: f"native step {row['tok_s_native']:.2f} tok/s, Python forward "
                                f"{row['tok_s_python']:.2f} ({row['speedup']:.3f}x; {row['native_blocks']} of "
                                f"{row['blocks']} blocks native)")


if __name__ == "__main__":
    sys.exit(main())
