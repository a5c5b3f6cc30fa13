"""Decode speed of SmolLM2-135M with the quantized KV cache against transformers' unquantized DynamicCache.

    python benchmarks/kv_decode_speed.py [--contexts 128,512,2048] [--configs k4,k8,k3-b16-o3-c2] [--steps 32]
        [--rounds 3] [--out FILE.json]

Protocol: batch 1, fp32 weights, transformers' forward; the first `context` tokens of WikiText-2 raw test fill the
cache in one forward pass, then `steps` greedy decode steps are timed (one token each). Every cache is timed once
per round, interleaved, and the median over rounds is kept, so machine noise hits all of them alike. Key ranges
are calibrated on the first 16 consecutive 512-token chunks of WikiText-2 validation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicCache

from kv_cache import CONFIGS, chosen_configs, model_text_calibration
from llmeasyquant.methods.simquant import SimQuant
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

COLUMNS = (("context", "context", "d"), ("cache", "cache", ""), ("decode tok/s", "decode_tok_s", ".1f"),
           ("× unquantized", "ratio", ".2f"))


@torch.no_grad()
def decode_rate(model: torch.nn.Module, prompt: torch.Tensor, new_cache: Callable[[], Cache], steps: int) -> float:
    """Tokens per second over `steps` greedy steps after a prefill of `prompt` [1, P]."""
    cache = new_cache()
    token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return steps / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--configs", default="k4,k8,k3-b16-o3-c2")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/kv_decode_speed.json")
    args = parser.parse_args()
    names = chosen_configs(parser, args.configs)
    model, tokenizer, text, calib, source = model_text_calibration(16)
    caches: dict[str, Callable[[], Cache]] = {"fp": lambda: DynamicCache(config=model.config)}
    for name in names:
        options, calibrated = CONFIGS[name]
        spec = SimQuant(KVQuantConfig(**options)).calibrate(model, calib if calibrated else None)
        caches[name] = lambda spec=spec: spec.new_cache(model)
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = tokenizer(text.text[: 40 * max(contexts)], return_tensors="pt").input_ids
    if ids.shape[1] < max(contexts):
        parser.error(f"the text gives {ids.shape[1]} tokens, fewer than the longest context {max(contexts)}")
    rows = []
    for context in contexts:
        rates: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(args.rounds):
            for name, new_cache in caches.items():
                rates[name].append(decode_rate(model, ids[:, :context], new_cache, args.steps))
        base = statistics.median(rates["fp"])
        for name, measured in rates.items():
            rate = statistics.median(measured)
            rows.append({"context": context, "cache": name, "decode_tok_s": rate, "ratio": rate / base,
                         "rounds": measured})
        print(markdown_table([r for r in rows if r["context"] == context], COLUMNS), flush=True)
    protocol = {"text_source": text.description, "text_sha256": text.sha256, "batch": 1, "weights": "fp32",
                "loop": "transformers", "steps": args.steps, "rounds": args.rounds,
                "calib_source": source.description, "calib_samples": int(calib.shape[0]), "calib_seqlen": 512,
                "threads": torch.get_num_threads()}
    write_records(args.out, Record.new("kv_decode_speed", "smollm2-135m", {"rows": rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
