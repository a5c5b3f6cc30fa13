"""SimQuant KV-cache benchmark on SmolLM2-135M: perplexity through the quantized cache, ablations, memory, generation.

    python benchmarks/kv_cache.py [--seqlen 512,2048] [--max-windows 20] [--configs k4,k3,...] [--text wikitext2]
        [--out FILE.json]

Protocol: WikiText-2 raw test (shipped, `wikitext2`; `--text pyref` the second domain, any text `--text` takes),
windows of `seqlen` tokens without BOS, the first `max_windows`;
fp32 weights; every window's keys and values are written to the cache and read back by attention. KL and top-1 are
against the same model with the unquantized cache. Key ranges are calibrated on the first 16 consecutive 512-token
chunks of WikiText-2 validation. Memory: one 2048-token window through the cache, bytes held by the cache object
against an fp16 cache of the same tokens. Generation: 5 prompts, 32 greedy tokens, against the unquantized cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids, load_text
from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
from llmeasyquant.methods.simquant import SimQuant
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

# name -> (cache options, calibrated key ranges?)
# "k3" rows are 3 bits with the options 4 bits default to; "k3-b16-o3-c2" is what 3 bits default to.
THREE = {"key_bits": 3, "value_bits": 3, "key_block": 32, "outliers": 0.01, "key_channels": 0}
CONFIGS: dict[str, tuple[dict, bool]] = {
    "k8": ({"key_bits": 8, "value_bits": 8}, True),
    "k4": ({}, True),
    "k3": (THREE, True),
    "k2": ({"key_bits": 2, "value_bits": 2}, True),
    # 3 bits with finer key blocks and three value outliers per vector: still below the 4-bit cache's memory
    "k3-b16-o3": (THREE | {"key_block": 16, "outliers": 0.047}, True),
    # ... and the 2 most sensitive key channels per head in fp16: the 3-bit defaults, still below 4-bit memory
    "k3-b16-o3-c2": (THREE | {"key_block": 16, "outliers": 0.047, "key_channels": 2}, True),
    # 3 bits with more side information than its defaults (ablations of the bytes against the accuracy)
    "k3-b8": (THREE | {"key_block": 8, "outliers": 0.047, "key_channels": 2}, True),
    "k3-c4": (THREE | {"key_block": 16, "outliers": 0.047, "key_channels": 4}, True),
    "k3-o5": (THREE | {"key_block": 16, "outliers": 0.078, "key_channels": 2}, True),
    "k3-b8-c4-o5": (THREE | {"key_block": 8, "outliers": 0.078, "key_channels": 4}, True),
    "k2-b8-c4-o5": ({"key_bits": 2, "value_bits": 2, "key_block": 8, "outliers": 0.078, "key_channels": 4}, True),
    # compact side information (block ends in 6 bits, kept channels in 8-bit codes, value outliers in 8 bits,
    # value ranges searched): the bytes saved buy more outliers and kept channels in no more memory
    "k3-b8-c4-o5-compact": (THREE | {"key_block": 8, "outliers": 0.078, "key_channels": 4, "compact": True}, True),
    "k3-b16-c8-o6-compact": (THREE | {"key_block": 16, "outliers": 0.094, "key_channels": 8, "compact": True}, True),
    "k4-compact": ({"compact": True}, True),
    "k2-b8-c8-o8-compact": ({"key_bits": 2, "value_bits": 2, "key_block": 8, "outliers": 0.125, "key_channels": 8,
                             "compact": True}, True),
    "k4-c2": ({"key_channels": 2}, True),
    "k4-nf": ({"levels": "nf"}, True),
    "k3-nf": (THREE | {"levels": "nf"}, True),
    "k2-nf": ({"key_bits": 2, "value_bits": 2, "levels": "nf"}, True),
    "k4-online": ({}, False),
    "k3-online": (THREE, False),
    # ablations: each removes one idea from k4 / k3
    "k4-b0": ({"key_block": 0}, True),
    "k4-b16": ({"key_block": 16}, True),
    "k4-b64": ({"key_block": 64}, True),
    "k4-token-keys": ({"key_axis": "token"}, True),
    "k4-post-rope": ({"pre_rope": False}, True),
    "k4-no-outliers": ({"outliers": 0.0}, True),
    "k4-no-sinks": ({"sinks": 0}, True),
    "k4-plain": ({"key_axis": "token", "pre_rope": False, "outliers": 0.0, "sinks": 0}, True),
    "k4-b0-online": ({"key_block": 0}, False),
    "k3-b0": (THREE | {"key_block": 0}, True),
    "k3-token-keys": (THREE | {"key_axis": "token"}, True),
    "k3-post-rope": (THREE | {"pre_rope": False}, True),
    "k3-no-outliers": (THREE | {"outliers": 0.0}, True),
    "k3-no-sinks": (THREE | {"sinks": 0}, True),
    "k3-plain": (THREE | {"key_axis": "token", "pre_rope": False, "outliers": 0.0, "sinks": 0}, True),
}
PROMPTS = (
    "The history of the city begins in",
    "In mathematics, a prime number is",
    "The recipe calls for two cups of flour and",
    "She opened the letter and read the first line:",
    "The main advantage of solar power is",
)
COLUMNS = (("seqlen", "seqlen", "d"), ("cache", "cache", ""), ("ppl", "ppl", ".3f"),
           ("Δppl %", "ppl_delta_pct", "+.2f"), ("KL", "kld", ".5f"), ("top-1 %", "top1_pct", ".2f"),
           ("eval s", "eval_s", ".1f"))


def chosen_configs(parser: argparse.ArgumentParser, configs: str) -> list[str]:
    """The names in a comma-separated --configs value; an unknown one ends the run with the known names."""
    names = [n.strip() for n in configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    return names


def model_text_calibration(samples: int, text: str = "wikitext2") -> tuple:
    """What every KV benchmark runs on: SmolLM2, the evaluation `text` (WikiText-2 raw test by default), and
    calibration ids from the first `samples` 512-token chunks of WikiText-2 validation (with their source)."""
    model, tokenizer = lq.load_model("smollm2-135m")
    text = load_text(text)
    calib, source = calibration_ids("wikitext2", model, tokenizer, samples, 512, 0)
    return model, tokenizer, text, calib, source


def cache_memory(model: torch.nn.Module, spec: lq.KVCacheSpec, ids: torch.Tensor) -> dict:
    """Bytes held after one forward pass over `ids`, quantized cache vs the unquantized one."""
    cache, plain = spec.new_cache(model), DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=cache, use_cache=True)
        model(ids[None], past_key_values=plain, use_cache=True)
    plain_bytes = sum(t.numel() * t.element_size() for layer in plain.layers for t in (layer.keys, layer.values))
    held = cache.nbytes()
    return {"tokens": int(ids.numel()), "bytes": held, "fp16_bytes": cache.fp16_bytes(),
            "fp32_dynamic_cache_bytes": plain_bytes, "ratio_to_fp16": held["total"] / cache.fp16_bytes()}


def generation_match(model: torch.nn.Module, tokenizer: object, spec: lq.KVCacheSpec, new_tokens: int = 32) -> dict:
    """Greedy continuations with the quantized cache against the unquantized cache: tokens equal before the first
    difference, per prompt."""
    agree = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
        plain = model.generate(ids, **options)[0, ids.shape[1]:]
        quant = model.generate(ids, past_key_values=spec.new_cache(model), **options)[0, ids.shape[1]:]
        same = (plain == quant).int()
        agree.append(int(same.cumprod(0).sum()))
    return {"prompts": len(PROMPTS), "new_tokens": new_tokens, "identical_prefix": agree,
            "all_identical": all(n == new_tokens for n in agree)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqlen", default="512,2048")
    parser.add_argument("--max-windows", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--text", default="wikitext2", help="evaluation text (calibration stays WikiText-2)")
    parser.add_argument("--no-extras", action="store_true", help="skip the memory and generation checks")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_cache.json"))
    args = parser.parse_args()
    names = chosen_configs(parser, args.configs)
    model, tokenizer, text, calib, source = model_text_calibration(args.calib_samples, args.text)
    specs, ranges = {}, {}
    for name in names:
        options, calibrated = CONFIGS[name]
        config = KVQuantConfig(**options)
        # Key ranges depend on these options only (not on the bit widths): calibrate once per distinct set.
        share = 0.0 if config.key_blocks else config.outliers
        key = (calibrated, config.sinks, config.pre_rope, config.key_axis, config.key_channels, share)
        if key not in ranges:
            ranges[key] = SimQuant(config).calibrate(model, calib if calibrated else None).key_ranges
        specs[name] = lq.KVCacheSpec(config, ranges[key])
    rows = []
    for seqlen in [int(s) for s in args.seqlen.split(",")]:
        windows = make_windows(tokenizer, text, seqlen, args.max_windows)
        caches = {name: (lambda spec=spec: spec.new_cache(model)) for name, spec in specs.items()}
        metrics = evaluate_windows({"fp": model} | {name: model for name in specs}, windows, reference="fp",
                                   caches=caches)
        base = metrics["fp"]["ppl"]
        for name, m in metrics.items():
            config = specs[name].config.to_dict() | {"calibrated": specs[name].key_ranges is not None} \
                if name in specs else None
            rows.append(m | {"seqlen": seqlen, "cache": name, "config": config, "top1_pct": 100 * m["top1"],
                             "ppl_delta_pct": 100 * (m["ppl"] / base - 1)})
        print(markdown_table([r for r in rows if r["seqlen"] == seqlen], COLUMNS), flush=True)
    extras = {}
    if not args.no_extras:
        ids = make_windows(tokenizer, text, 2048, 1).ids[0]
        extras["memory_2048"] = {name: cache_memory(model, specs[name], ids) for name in names}
        extras["generation"] = {name: generation_match(model, tokenizer, specs[name]) for name in names
                                if name in ("k8", "k4", "k3")}
        for name, mem in extras["memory_2048"].items():
            print(f"{name}: {mem['bytes']['total']} bytes at 2048 tokens, {mem['ratio_to_fp16']:.3f} of fp16")
        for name, gen in extras["generation"].items():
            print(f"{name}: identical greedy prefix per prompt {gen['identical_prefix']} of {gen['new_tokens']}")
    protocol = windows.protocol | {"max_windows": args.max_windows, "weights": "fp32",
                                   "calib_source": source.description, "calib_sha256": source.sha256,
                                   "calib_samples": int(calib.shape[0]), "calib_seqlen": 512,
                                   "threads": torch.get_num_threads()}
    write_records(args.out, Record.new("kv_cache", "smollm2-135m", {"rows": rows, **extras}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
