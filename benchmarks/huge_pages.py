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
import random
import statistics
import sys
from pathlib import Path

import torch

from llmeasyquant import fuse_shared_inputs, load
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.record import Record, read_records, write_records
from llmeasyquant.runtime.decoder import LeanDecoder
from scale_speed import conditions, decode_speed, machine


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
    models = {"4k": loaded(checkpoint), "2m": loaded(checkpoint)}
    before = anon_huge_bytes()
    moved = place_on_huge_pages(models["2m"])
    backed = anon_huge_bytes()
    prompt = torch.randint(0, models["4k"].config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(args.seed))
    tokens = {k: LeanDecoder(m, args.prompt_tokens + 4).generate(prompt, 4) for k, m in models.items()}
    if not torch.equal(tokens["4k"], tokens["2m"]):
        raise SystemExit("the two copies decode different tokens: the move changed the weights")
    order = random.Random(args.seed)
    rounds = []
    for index in range(args.rounds):
        sides = list(models)
        order.shuffle(sides)
        round_ = {"round": index, "order": sides}
        for side in sides:
            decode_speed(models[side], prompt[:, :8], 3)
            round_[side] = decode_speed(models[side], prompt, args.new_tokens)
        round_["conditions"] = conditions()
        rounds.append(round_)
        print(f"{checkpoint.name} round {index}: 4 KiB {round_['4k']:.2f}, 2 MiB {round_['2m']:.2f} tok/s", flush=True)
    medians = {side: statistics.median(r[side] for r in rounds) for side in models}
    return {"tok_s_4k": medians["4k"], "tok_s_2m": medians["2m"], "speedup": medians["2m"] / medians["4k"],
            "rounds_2m_faster": sum(r["2m"] > r["4k"] for r in rounds), "rounds": rounds,
            "bytes_moved": moved, "anon_huge_bytes_before": before, "anon_huge_bytes_after": backed,
            "same_tokens": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/huge_pages.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 2 or args.prompt_tokens < 8:
        parser.error("need --rounds >= 1, --new-tokens >= 2 and --prompt-tokens >= 8")
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(before)
    return 0


def run(args: argparse.Namespace) -> None:
    protocol = {"batch": 1, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "rounds": args.rounds, "seed": args.seed,
                "runtime": "lean (fused operators), q/k/v and gate/up fused", "machine": machine(),
                "compared": "the same checkpoint loaded twice in one process, one copy moved onto 2 MiB pages; "
                            "both timed in every round, in a shuffled order"}
    for checkpoint in args.checkpoints:
        row = measure(checkpoint, args)
        command = (f"python benchmarks/huge_pages.py {checkpoint.name} --rounds {args.rounds} --threads "
                   f"{args.threads} --prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens}")
        records = read_records(args.out) if args.out.is_file() else []
        write_records(args.out, [r for r in records if r.model != checkpoint.name]
                      + [Record.new("huge_pages", checkpoint.name, row, protocol, command)])
        print(f"{checkpoint.name}: 4 KiB pages {row['tok_s_4k']:.2f} tok/s, 2 MiB pages {row['tok_s_2m']:.2f} "
              f"({row['speedup']:.3f}x; faster in {row['rounds_2m_faster']} of {args.rounds} rounds)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
