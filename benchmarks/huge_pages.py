"""Decode speed with the weights on 4 KiB pages (as loading leaves them) against 2 MiB pages
(nn/placement.place_on_huge_pages, what `bench`, `serve` and scale_speed.py do), in one process.

    python benchmarks/huge_pages.py CHECKPOINT [CHECKPOINT ...] [--rounds 6] [--threads 2] [--prompt-tokens 32]
        [--new-tokens 16] [--out benchmarks/results/huge_pages.json]

Per checkpoint: load it twice (export/checkpoint.load) and fuse q/k/v and gate/up in both, move one copy's weights
onto huge pages, check that both decode the same greedy tokens, then `--rounds` rounds, each timing both copies in
a shuffled order (a warm-up of 3 tokens, then our greedy lean-loop decode of `--new-tokens` after a
`--prompt-tokens` prompt of seeded random ids; tokens/s over the steps after the first). Medians over rounds, and
how many rounds each side won: the host is shared and noisy, so the two are compared within each round. The
process's AnonHugePages after the move says how much the kernel actually backed with huge pages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from llmeasyquant import fuse_shared_inputs, load
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.runtime.decoder import LeanDecoder
from same_process_ab import parse, parser, run_each, timed_rounds
from scale_speed import decode_speed


def anon_huge_bytes() -> int | None:
    """This process's anonymous memory on transparent huge pages (Linux), else None."""
    rollup = Path("/proc/self/smaps_rollup")
    if not rollup.is_file():
        return None
    line = next((line for line in rollup.read_text().splitlines() if line.startswith("AnonHugePages:")), None)
    return int(line.split()[1]) * 1024 if line else None


def loaded(checkpoint: Path) -> torch.nn.Module:
    model, _ = load(checkpoint)
    fuse_shared_inputs(model)
    return model.eval()


def measure(checkpoint: Path, args: argparse.Namespace) -> dict:
    models = {"2m": loaded(checkpoint), "4k": loaded(checkpoint)}
    before = anon_huge_bytes()
    moved = place_on_huge_pages(models["2m"])
    backed = anon_huge_bytes()
    prompt = torch.randint(0, models["4k"].config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(args.seed))
    tokens = {k: LeanDecoder(m, args.prompt_tokens + 4).generate(prompt, 4) for k, m in models.items()}
    if not torch.equal(tokens["4k"], tokens["2m"]):
        raise SystemExit("the two copies decode different tokens: the move changed the weights")

    def timed(model: torch.nn.Module) -> float:
        decode_speed(model, prompt[:, :8], 3)  # a warm-up
        return decode_speed(model, prompt, args.new_tokens)

    found = timed_rounds(checkpoint.name, {side: (lambda m=model: timed(m)) for side, model in models.items()},
                         args.rounds, args.seed)
    return {**found, "bytes_moved": moved, "anon_huge_bytes_before": before, "anon_huge_bytes_after": backed,
            "same_tokens": True}


def main(argv: list[str] | None = None) -> int:
    args = parse(parser(__doc__, "benchmarks/results/huge_pages.json"), argv)
    protocol = {"runtime": "lean (fused operators), q/k/v and gate/up fused",
                "compared": "the same checkpoint loaded twice in one process, one copy moved onto 2 MiB pages; "
                            "both timed in every round, in a shuffled order"}
    return run_each(args, "huge_pages.py", "huge_pages", protocol, measure,
                    lambda row: f"4 KiB pages {row['tok_s_4k']:.2f} tok/s, 2 MiB pages {row['tok_s_2m']:.2f} "
                                f"({row['speedup']:.3f}x)")


if __name__ == "__main__":
    sys.exit(main())
