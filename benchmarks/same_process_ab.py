"""What the same-process A/B benchmarks share (huge_pages.py, native_step.py): two ways of decoding one checkpoint,
both timed in every round in a shuffled order (the host is shared and noisy, so the two are compared within each
round), medians and wins over the rounds, the options, the thread count set for the run, and one record per
checkpoint in the results file."""

from __future__ import annotations

import argparse
import functools
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from llmeasyquant.record import Record, read_records, write_records
from scale_speed import conditions, machine


def parser(description: str, default_out: str) -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("checkpoints", type=Path, nargs="+")
    found.add_argument("--rounds", type=int, default=6)
    found.add_argument("--threads", type=int, default=2)
    found.add_argument("--prompt-tokens", type=int, default=32)
    found.add_argument("--new-tokens", type=int, default=16)
    found.add_argument("--seed", type=int, default=0)
    found.add_argument("--out", type=Path, default=Path(default_out))
    return found


def parse(found: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = found.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 2 or args.prompt_tokens < 8:
        found.error("need --rounds >= 1, --new-tokens >= 2 and --prompt-tokens >= 8")
    return args


def timed_rounds(name: str, sides: dict[str, Callable[[], float]], rounds: int, seed: int) -> dict:
    """`rounds` rounds, each calling every side (its tokens/s) in a shuffled order: the rounds, each side's median
    (`tok_s_SIDE`) and how many rounds the first side was the faster (`rounds_won`)."""
    order = random.Random(seed)
    found = []
    for index in range(rounds):
        names = list(sides)
        order.shuffle(names)
        round_ = {"round": index, "order": names, **{side: sides[side]() for side in names}, "conditions": conditions()}
        found.append(round_)
        print(f"{name} round {index}: " + ", ".join(f"{side} {round_[side]:.2f}" for side in sides) + " tok/s",
              flush=True)
    first, second = list(sides)
    medians = {side: statistics.median(r[side] for r in found) for side in sides}
    return {**{f"tok_s_{side}": medians[side] for side in sides}, "speedup": medians[first] / medians[second],
            "rounds_won": sum(r[first] > r[second] for r in found), "rounds": found}


def decode_and_prefill_rounds(name: str, rate: Callable[[str, str], float], sides: tuple[str, str],
                               args: argparse.Namespace) -> dict:
    """`timed_rounds` for decode, then for prefill; `rate(side, what)` is one side's tokens/s at "decode" or
    "prefill". The decode medians at the top of the result, the prefill's under "prefill"."""
    found = {what: timed_rounds(f"{name} {what}", {side: functools.partial(rate, side, what) for side in sides},
                                args.rounds, args.seed)
             for what in ("decode", "prefill")}
    return {**found["decode"], "prefill": found["prefill"]}


def decode_and_prefill_summary(first: str, second: str) -> Callable[[dict], str]:
    """The printed line for a `decode_and_prefill_rounds` result of the sides `first` and `second`."""
    def summary(row: dict) -> str:
        prefill = row["prefill"]
        return (f"decode: {first} {row[f'tok_s_{first}']:.2f} tok/s, {second} {row[f'tok_s_{second}']:.2f} "
                f"({row['speedup']:.3f}x); prefill: {first} {prefill[f'tok_s_{first}']:.1f}, {second} "
                f"{prefill[f'tok_s_{second}']:.1f} ({prefill['speedup']:.3f}x)")
    return summary


def run_each(args: argparse.Namespace, script: str, kind: str, protocol: dict,
             measure: Callable[[Path, argparse.Namespace], dict], summary: Callable[[dict], str]) -> int:
    """Measure every checkpoint with the run's thread count (the process's restored after), replacing its record in
    `--out`; the command recorded names the checkpoint, not where it lies."""
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    protocol = {"batch": 1, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "rounds": args.rounds, "seed": args.seed, "machine": machine(),
                **protocol}
    try:
        for checkpoint in args.checkpoints:
            row = measure(checkpoint, args)
            command = (f"python benchmarks/{script} {checkpoint.name} --rounds {args.rounds} --threads "
                       f"{args.threads} --prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens}")
            records = read_records(args.out) if args.out.is_file() else []
            write_records(args.out, [r for r in records if r.model != checkpoint.name]
                          + [Record.new(kind, checkpoint.name, row, protocol, command)])
            print(f"{checkpoint.name}: {summary(row)} (faster in {row['rounds_won']} of {args.rounds} rounds)",
                  flush=True)
    finally:
        torch.set_num_threads(before)
    return 0
