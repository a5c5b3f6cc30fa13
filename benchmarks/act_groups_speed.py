"""What activation groups (`--act-group-size`) cost in speed: one checkpoint whose layers scale activations per token
per group of channels, loaded twice in one process, once as stored and once with one scale a token (the same weights
and the same native W4A8 kernel; only the activation scales differ), each with its own lean decoder.

    python benchmarks/act_groups_speed.py CHECKPOINT [CHECKPOINT ...] [--rounds 6] [--threads 2]
        [--prompt-tokens 32] [--new-tokens 16] [--prefill-tokens 512] [--out benchmarks/results/act_groups_speed.json]

Per checkpoint: `--rounds` rounds, each timing both ways in a shuffled order: a prefill of a `--prompt-tokens` prompt
of seeded random ids and `--new-tokens` greedy steps (tokens/s over the steps), and a prefill of `--prefill-tokens`
tokens (tokens/s). Medians over rounds, and how many rounds the grouped side won (same_process_ab.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

from act_clip_speed import decode_rate, prefill_rate
from llmeasyquant import fuse_shared_inputs, load
from llmeasyquant.errors import ConfigError
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.runtime.decoder import LeanDecoder
from llmeasyquant.scheme import PerToken
from same_process_ab import decode_and_prefill_rounds, decode_and_prefill_summary, parse, parser, run_each


def one_scale_a_token(model: nn.Module) -> None:
    """Every quantized layer with activation groups takes one activation scale a token instead (before any kernel
    is chosen or prepared, and before q/k/v and gate/up are fused, so the combined layers follow)."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.scheme.act is not None:
            act = dataclasses.replace(module.scheme.act, granularity=PerToken())
            module.scheme = dataclasses.replace(module.scheme, act=act)


def measure(checkpoint: Path, args: argparse.Namespace) -> dict:
    grouped, _ = load(checkpoint)
    if not any(isinstance(m, QuantLinear) and m.scheme.act is not None and m.scheme.act.group_size
               for m in grouped.modules()):
        raise ConfigError(f"{checkpoint} has no layer with activation groups: quantize with --act-group-size")
    per_token, _ = load(checkpoint)
    one_scale_a_token(per_token)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, grouped.config.vocab_size, (1, args.prompt_tokens), generator=generator)
    long = torch.randint(0, grouped.config.vocab_size, (1, args.prefill_tokens), generator=generator)
    decoders = {}
    for name, model in (("groups", grouped), ("token", per_token)):
        fuse_shared_inputs(model)
        model.eval()
        decoders[name] = LeanDecoder(model, max(args.prompt_tokens + args.new_tokens, args.prefill_tokens))
    def rate(side: str, what: str) -> float:
        decoder = decoders[side]
        return decode_rate(decoder, prompt, args.new_tokens) if what == "decode" else prefill_rate(decoder, long)

    return decode_and_prefill_rounds(checkpoint.name, rate, ("groups", "token"), args)


def main(argv: list[str] | None = None) -> int:
    found = parser(__doc__, "benchmarks/results/act_groups_speed.json")
    found.add_argument("--prefill-tokens", type=int, default=512)
    args = parse(found, argv)
    protocol = {"runtime": "lean (fused operators), q/k/v and gate/up fused, kernels measured",
                "prefill_tokens": args.prefill_tokens,
                "compared": "the checkpoint loaded twice: activation scales per token per group as stored, and one "
                            "a token; both timed in every round, in a shuffled order"}
    return run_each(args, "act_groups_speed.py", "act_groups_speed", protocol, measure,
                    decode_and_prefill_summary("groups", "token"))


if __name__ == "__main__":
    sys.exit(main())
