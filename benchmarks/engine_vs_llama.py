"""Batch-1 decode and a 512-token prefill on the engine's forward (the path `generate`, `chat` and `serve` run)
against llama.cpp's `llama-bench` on the same bits, rounds interleaved, in one run.

    python benchmarks/engine_vs_llama.py --model smollm2-135m --work SCRATCH --llama-bench PATH
        [--pairs w8a8,w4a16-g32,w4a8-g32] [--rounds 3] [--threads 2] [--prompt-tokens 128] [--new-tokens 128]
        [--prefill-tokens 512] [--out benchmarks/results/engine_vs_llama.json]

`--model` is a model spec (smollm2-135m, the bundled model) or a Hugging Face folder (a synthetic shape of
benchmarks/make_synthetic.py: quantized with `--stream`). Matched pairs (PAIRS):
- `w8a8`: ours RTN W8A8 per channel with the LM head W8A8 (8.0 bits a weight plus a scale a row) against Q8_0, our
  lossless export of RTN W8A16 g32 with its head (8.5 bits): we read 6% fewer bytes, said in every record;
- `w4a16-g32`: ours RTN W4A16 g32 symmetric with the head W4A16 g32 against the same checkpoint exported to GGUF,
  Q4_0 throughout, bit for bit the same weights and bytes;
- `w4a8-g32`: the same weights with int8 activations, one symmetric scale per token per 32 columns (`--act-bits 8
  --act-group-size 32`), head too, against the same Q4_0 file: the arithmetic of llama.cpp's Q4_0 dot product,
  which rounds the activations to Q8_0 blocks of 32 (an fp16 scale each, where ours is fp32).
Each round measures the read bandwidth (eval/bench.py), then, in a shuffled order: ours (weights fused and on 2 MiB
pages, as `serve` loads them; the KV cache in fp16 as `serve` keeps it) decoding `--new-tokens` greedy tokens after
a `--prompt-tokens` prompt (ms a token over the steps after the first) and prefilling `--prefill-tokens` tokens in
one step (after an untimed one); `llama-bench -p 0 -n NEW -r 1` and `-p PREFILL -n 0 -r 1` on the GGUF; and
transformers' fp32 forward over the same `--prefill-tokens` prompt (the prefill target's baseline). Prompts:
WikiText-2 raw test (shipped). Medians of the rounds; the bound is the weight bytes a token reads over the median
bandwidth; every record names the CPU, its instruction sets, threads, versions and the llama.cpp build.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmeasyquant.calibration.data import load_text, tokenize
from llmeasyquant.eval.bench import memory_bandwidth_gbs, weight_bytes_per_token
from llmeasyquant.eval.speed import _fill_cache
from llmeasyquant.export.checkpoint import load
from llmeasyquant.models.load import load_model
from llmeasyquant.nn.fused import fuse_shared_inputs
from llmeasyquant.nn.placement import place_on_huge_pages
from llmeasyquant.record import Record, write_records
from llmeasyquant.runtime.decoder import LeanDecoder
from scale_speed import conditions, gguf_bytes_per_token, llama_bench, machine

# pair: (our quantize flags, our head, the peer's GGUF type, its checkpoint's flags and head, or None: ours exported)
PAIRS = {
    "w8a8": (["--bits", "8", "--act-bits", "8"], "w8a8", "Q8_0", (["--bits", "8", "--group-size", "32"], "w8a16-g32")),
    "w4a16-g32": (["--bits", "4", "--group-size", "32"], "w4a16-g32", "Q4_0", None),
    "w4a8-g32": (["--bits", "4", "--group-size", "32", "--act-bits", "8", "--act-group-size", "32"], "w4a8-g32-ag32",
                 "Q4_0", None),
}

def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--quiet", *args], check=True)


def quantize(model: str, work: Path, name: str, flags: list[str], head: str) -> Path:
    out = work / name
    if not (out / "config.json").is_file():
        stream = ["--stream"] if Path(model).is_dir() else []
        cli("quantize", model, "--method", "rtn", *flags, "--lm-head", head, *stream, "--force", "--out", str(out))
    return out


def gguf(checkpoint: Path, path: Path) -> Path:
    if not path.is_file():
        cli("export", str(checkpoint), "--to", "gguf", "--no-check", "--force", "--out", str(path))
    return path


def loaded(checkpoint: Path) -> torch.nn.Module:
    model, _ = load(checkpoint)
    fuse_shared_inputs(model)  # as `serve` loads it (runtime/engine.py Engine.load)
    place_on_huge_pages(model)
    return model.eval()


@torch.no_grad()
def ours(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, long_prompt: torch.Tensor) -> dict:
    decoder = LeanDecoder(model, prompt.shape[1] + new_tokens, kv_dtype="float16")
    token = decoder.prefill(prompt).argmax()
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = decoder.step(token).argmax()
    decode_ms = 1000 * (time.perf_counter() - start) / (new_tokens - 1)
    prefill = LeanDecoder(model, long_prompt.shape[1], kv_dtype="float16")
    prefill.prefill(long_prompt)  # kernels for the row count are chosen (timed) on the first call
    prefill.reset()
    start = time.perf_counter()
    prefill.prefill(long_prompt)
    return {"decode_ms": decode_ms, "prefill_tok_s": long_prompt.shape[1] / (time.perf_counter() - start)}


@torch.no_grad()
def transformers_prefill(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    _fill_cache(model, prompt[None])
    start = time.perf_counter()
    _fill_cache(model, prompt[None])
    return prompt.shape[0] / (time.perf_counter() - start)


def peer(binary: Path, path: Path, args: argparse.Namespace) -> dict:
    decode = llama_bench(binary, path, args.new_tokens, args.threads, args.timeout)
    prefill = llama_bench(binary, path, 0, args.threads, args.timeout, prompt_tokens=args.prefill_tokens)
    if "error" in decode or "error" in prefill:
        raise SystemExit(f"llama-bench failed on {path.name}: {decode.get('error') or prefill.get('error')}")
    return {"decode_ms": 1000 / decode["tok_s"], "prefill_tok_s": prefill["tok_s"], "build": decode["build"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--llama-bench", type=Path, required=True)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_vs_llama.json"))
    args = parser.parse_args(argv)
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown or args.rounds < 1 or args.new_tokens < 2:
        parser.error(f"pairs are {', '.join(PAIRS)} (got {unknown}); --rounds >= 1, --new-tokens >= 2")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    float_model, tokenizer = load_model(args.model)
    ids = tokenize(tokenizer, load_text("wikitext2").text)
    prompt, long_prompt = ids[: args.prompt_tokens], ids[: args.prefill_tokens]

    sides: dict[str, dict] = {}
    for pair in pairs:
        flags, head, qtype, peer_recipe = PAIRS[pair]
        checkpoint = quantize(args.model, args.work, f"{name}-{pair}-head", flags, head)
        peer_checkpoint = (checkpoint if peer_recipe is None else
                           quantize(args.model, args.work, f"{name}-{qtype}-g32", *peer_recipe))
        model = loaded(checkpoint)
        path = gguf(peer_checkpoint, args.work / f"{name}-{qtype}.gguf")
        sides[pair] = {"model": model, "gguf": path, "qtype": qtype, "bytes": weight_bytes_per_token(model),
                       "peer_bytes": gguf_bytes_per_token(path)}
        ours(model, prompt[None], 4, long_prompt[None])  # kernels chosen, buffers made, before the rounds

    order = random.Random(args.seed)
    rounds = []
    for index in range(args.rounds):
        found: dict[str, dict] = {"conditions": conditions(), "bandwidth_gbs": memory_bandwidth_gbs()}
        jobs = [(pair, side) for pair in pairs for side in ("ours", "llama.cpp")] + [("fp32", "transformers")]
        order.shuffle(jobs)
        for pair, side in jobs:
            if side == "transformers":
                found["transformers_prefill_tok_s"] = transformers_prefill(float_model, long_prompt)
            elif side == "ours":
                found.setdefault(pair, {})["ours"] = ours(sides[pair]["model"], prompt[None], args.new_tokens,
                                                          long_prompt[None])
            else:
                found.setdefault(pair, {})["llama.cpp"] = peer(args.llama_bench, sides[pair]["gguf"], args)
        rounds.append(found)
        print(f"round {index}: " + "; ".join(
            f"{pair} decode ours {found[pair]['ours']['decode_ms']:.2f} ms, llama.cpp "
            f"{found[pair]['llama.cpp']['decode_ms']:.2f}; prefill ours {found[pair]['ours']['prefill_tok_s']:.0f} "
            f"tok/s, llama.cpp {found[pair]['llama.cpp']['prefill_tok_s']:.0f}" for pair in pairs)
            + f"; transformers prefill {found['transformers_prefill_tok_s']:.0f}", flush=True)

    def median(pair: str, side: str, key: str) -> float:
        return statistics.median(r[pair][side][key] for r in rounds)

    transformers = statistics.median(r["transformers_prefill_tok_s"] for r in rounds)
    records = []
    for pair in pairs:
        side = sides[pair]
        metrics = {
            "decode_ms_ours": median(pair, "ours", "decode_ms"), "decode_ms_llama": median(pair, "llama.cpp",
                                                                                           "decode_ms"),
            "prefill_tok_s_ours": median(pair, "ours", "prefill_tok_s"),
            "prefill_tok_s_llama": median(pair, "llama.cpp", "prefill_tok_s"),
            "prefill_tok_s_transformers_fp32": transformers,
            "weight_bytes_per_token_ours": side["bytes"], "weight_bytes_per_token_llama": side["peer_bytes"],
            "rounds": [{"conditions": r["conditions"], "bandwidth_gbs": r["bandwidth_gbs"], **r[pair],
                        "transformers_prefill_tok_s": r["transformers_prefill_tok_s"]} for r in rounds]}
        metrics["decode_speedup"] = metrics["decode_ms_llama"] / metrics["decode_ms_ours"]
        # The bound: this round's read bandwidth over the weight bytes a token reads (the speed of light).
        metrics["bandwidth_gbs"] = statistics.median(r["bandwidth_gbs"] for r in rounds)
        metrics["bound_ms"] = 1000 * side["bytes"] / (metrics["bandwidth_gbs"] * 1e9)
        metrics["share_of_bound"] = metrics["bound_ms"] / metrics["decode_ms_ours"]
        metrics["prefill_vs_llama"] = metrics["prefill_tok_s_ours"] / metrics["prefill_tok_s_llama"]
        metrics["prefill_vs_transformers"] = metrics["prefill_tok_s_ours"] / transformers
        metrics["scheme"], metrics["peer"] = pair, side["qtype"]
        command = "python benchmarks/engine_vs_llama.py " + " ".join(
            a if not a.startswith("/") else Path(a).name for a in (argv if argv is not None else sys.argv[1:]))
        records.append(Record.new("engine_vs_llama", args.model if not Path(args.model).is_dir() else name, metrics,
                                  {"threads": args.threads, "prompt_tokens": args.prompt_tokens,
                                   "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens,
                                   "rounds": args.rounds, "kv_cache": "float16",
                                   "llama_cpp_build": rounds[0][pair]["llama.cpp"]["build"],
                                   "cpu": machine()}, command))
        print(f"{pair}: decode {metrics['decode_ms_ours']:.2f} ms against {metrics['decode_ms_llama']:.2f} "
              f"({metrics['decode_speedup']:.2f}x; {100 * metrics['share_of_bound']:.0f}% of the bound), "
              f"prefill {metrics['prefill_tok_s_ours']:.0f} tok/s against "
              f"{metrics['prefill_tok_s_llama']:.0f} ({metrics['prefill_vs_llama']:.2f}x; "
              f"{metrics['prefill_vs_transformers']:.2f}x transformers fp32)")
    write_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
