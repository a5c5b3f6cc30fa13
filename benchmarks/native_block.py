"""Decode speed with each block of a step as one native call (runtime/native_block.py, what the lean loop does
where a block's linears all take W4A16's digits kernel) against the same blocks on the Python loop, in one process.

    python benchmarks/native_block.py CHECKPOINT [CHECKPOINT ...] [--rounds 6] [--threads 2] [--prompt-tokens 32]
        [--new-tokens 16] [--out benchmarks/results/native_block.json]

Per checkpoint: load it (export/checkpoint.load), fuse q/k/v and gate/up, move the weights onto 2 MiB pages (as
`bench` and scale_speed.py do), build one lean decoder, check that the two ways give the same logits bit for bit over
`--new-tokens` forced steps, then `--rounds` rounds, each timing both ways in a shuffled order (a prefill of a
`--prompt-tokens` prompt of seeded random ids, then `--new-tokens` greedy steps; tokens/s over the steps). Medians
over rounds, and how many rounds each side won: the host is shared and noisy, so the two are compared within each
round. The kernels are the registry's measured choice (as in `bench`); the record says how many blocks qualified.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from llmeasyquant import fuse_shared_inputs, load
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.record import Record, read_records, write_records
from llmeasyquant.runtime.decoder import LeanDecoder
from scale_speed import conditions, machine

SIDES = ("native", "python")


@torch.no_grad()
def steps(decoder: LeanDecoder, native: bool, prompt: torch.Tensor, new_tokens: int,
          forced: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    """Seconds of `new_tokens` steps after a prefill of `prompt`, and their logits; greedy unless `forced`."""
    decoder.native_blocks = native
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
    logits = {side: steps(decoder, side == "native", prompt, args.new_tokens, forced)[1] for side in SIDES}
    if not torch.equal(logits["native"], logits["python"]):
        raise SystemExit("the native blocks and the Python loop give different logits")
    decoder.native_blocks = True
    qualifying = sum(arguments is not None for arguments in decoder.step_blocks())
    order = random.Random(args.seed)
    rounds = []
    for index in range(args.rounds):
        sides = list(SIDES)
        order.shuffle(sides)
        round_ = {"round": index, "order": sides}
        for side in sides:
            round_[side] = args.new_tokens / steps(decoder, side == "native", prompt, args.new_tokens)[0]
        round_["conditions"] = conditions()
        rounds.append(round_)
        print(f"{checkpoint.name} round {index}: native {round_['native']:.2f}, python {round_['python']:.2f} tok/s",
              flush=True)
    medians = {side: statistics.median(r[side] for r in rounds) for side in SIDES}
    return {"tok_s_native": medians["native"], "tok_s_python": medians["python"],
            "speedup": medians["native"] / medians["python"],
            "rounds_native_faster": sum(r["native"] > r["python"] for r in rounds), "rounds": rounds,
            "blocks": len(decoder.blocks), "native_blocks": qualifying, "huge_page_bytes": moved,
            "same_logits": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/native_block.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        parser.error("need --rounds >= 1, --new-tokens >= 2 and --prompt-tokens >= 1")
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
                "runtime": "lean (fused operators), q/k/v and gate/up fused, weights on 2 MiB pages, kernels "
                           "measured", "machine": machine(),
                "compared": "one decoder, each block of a step as one native call or on the Python loop; both "
                            "timed in every round, in a shuffled order"}
    for checkpoint in args.checkpoints:
        row = measure(checkpoint, args)
        command = (f"python benchmarks/native_block.py {checkpoint.name} --rounds {args.rounds} --threads "
                   f"{args.threads} --prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens}")
        records = read_records(args.out) if args.out.is_file() else []
        write_records(args.out, [r for r in records if r.model != checkpoint.name]
                      + [Record.new("native_block", checkpoint.name, row, protocol, command)])
        print(f"{checkpoint.name}: native blocks {row['tok_s_native']:.2f} tok/s, Python loop "
              f"{row['tok_s_python']:.2f} ({row['speedup']:.3f}x; faster in {row['rounds_native_faster']} of "
              f"{args.rounds} rounds; {row['native_blocks']} of {row['blocks']} blocks native)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
