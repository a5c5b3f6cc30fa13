"""What `--act-clip search` costs in speed: one checkpoint whose layers search each token's clip, decoded and
prefilled as it is and with every layer's clip set to one fraction instead (the same weights and kernels; only the
clipping before the kernel differs), in one process.

    python benchmarks/act_clip_speed.py CHECKPOINT [CHECKPOINT ...] [--fraction 0.9] [--rounds 6] [--threads 2]
        [--prompt-tokens 32] [--new-tokens 16] [--prefill-tokens 512] [--out benchmarks/results/act_clip_speed.json]

Per checkpoint: load it (export/checkpoint.load), fuse q/k/v and gate/up, build one lean decoder, then `--rounds`
rounds, each timing both ways in a shuffled order: a prefill of a `--prompt-tokens` prompt of seeded random ids and
`--new-tokens` greedy steps (tokens/s over the steps), and a prefill of `--prefill-tokens` tokens (tokens/s).
Medians over rounds, and how many rounds the searching side won (same_process_ab.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch import nn

from llmeasyquant import fuse_shared_inputs, load
from llmeasyquant.errors import ConfigError
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.runtime.decoder import LeanDecoder
from same_process_ab import decode_and_prefill_rounds, decode_and_prefill_summary, parse, parser, run_each


def set_clipping(model: nn.Module, search: bool, fraction: float) -> None:
    """Every quantized layer (and each fused group's combined layer) searches its clip, or clips at `fraction`."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.scheme.act is not None:
            act = dataclasses.replace(module.scheme.act, clip=1.0 if search else fraction, clip_search=search)
            layers = [module] + ([module.shared[0].combined] if module.shared is not None else [])
            for layer in layers:
                layer.scheme = dataclasses.replace(layer.scheme, act=act)


@torch.no_grad()
def decode_rate(decoder: LeanDecoder, prompt: torch.Tensor, new_tokens: int) -> float:
    decoder.reset()
    token = decoder.prefill(prompt).argmax()
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = decoder.step(token).argmax()
    return new_tokens / (time.perf_counter() - start)


@torch.no_grad()
def prefill_rate(decoder: LeanDecoder, prompt: torch.Tensor) -> float:
    decoder.reset()
    start = time.perf_counter()
    decoder.prefill(prompt)
    return prompt.shape[1] / (time.perf_counter() - start)


def measure(checkpoint: Path, args: argparse.Namespace) -> dict:
    model, _ = load(checkpoint)
    if not any(isinstance(m, QuantLinear) and m.scheme.act is not None and m.scheme.act.clip_search
               for m in model.modules()):
        raise ConfigError(f"{checkpoint} has no layer that searches its clip: quantize with --act-clip search")
    fuse_shared_inputs(model)
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=generator)
    long = torch.randint(0, model.config.vocab_size, (1, args.prefill_tokens), generator=generator)
    decoder = LeanDecoder(model, max(args.prompt_tokens + args.new_tokens, args.prefill_tokens))

    def rate(side: str, what: str) -> float:
        set_clipping(model, side == "search", args.fraction)
        return decode_rate(decoder, prompt, args.new_tokens) if what == "decode" else prefill_rate(decoder, long)

    found = decode_and_prefill_rounds(checkpoint.name, rate, ("search", "fixed"), args)
    set_clipping(model, True, args.fraction)
    return {**found, "fraction": args.fraction}


def main(argv: list[str] | None = None) -> int:
    found = parser(__doc__, "benchmarks/results/act_clip_speed.json")
    found.add_argument("--fraction", type=float, default=0.9)
    found.add_argument("--prefill-tokens", type=int, default=512)
    args = parse(found, argv)
    protocol = {"runtime": "lean (fused operators), q/k/v and gate/up fused, kernels measured",
                "prefill_tokens": args.prefill_tokens,
                "compared": "one decoder, every layer searching each token's clip or clipping at --fraction; both "
                            "timed in every round, in a shuffled order"}
    return run_each(args, "act_clip_speed.py", "act_clip_speed", protocol, measure,
                    decode_and_prefill_summary("search", "fixed"))


if __name__ == "__main__":
    sys.exit(main())
