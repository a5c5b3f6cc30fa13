"""What rotate's online Hadamard transform (`--online-rotation`) costs at run time, on SmolLM2-135M's shapes.

    python benchmarks/online_hadamard.py [--threads 2] [--rounds 3] [--new-tokens 64]
        [--out benchmarks/results/online_hadamard.json]

A random model of SmolLM2-135M's shape (30 blocks, hidden 576, intermediate 1536 = 512 x 3), W8A8 round to nearest
(the weights' values do not change the time). Operator level: the transform of 1 and 512 rows of 1536 (native
operator and the PyTorch fallback) against the W8A8 down projection's own call at those rows. Decode: the lean
decoder's greedy steps after a 128-token prompt (the steps alone timed), with every down projection's transform
attached and detached in alternate rounds of one process (medians), so that a loaded machine slows both alike.
Speed only: the transform is attached to weights that were not rotated, so the logits are not meaningful.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import llmeasyquant as lq
from kernel_speed import median_ms  # benchmarks/ is the script's own folder, first on the path
from llmeasyquant import LeanDecoder
from llmeasyquant.kernels.hadamard import hadamard_reference, hadamard_transform
from llmeasyquant.methods.rotate import rotation_factors
from llmeasyquant.nn.transform import HadamardTransform, attach_input_transform
from llmeasyquant.record import Record, write_records

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
PROMPT = 128


def decode_tokens_per_s(model: torch.nn.Module, ids: torch.Tensor, new: int) -> float:
    decoder = LeanDecoder(model, PROMPT + new)
    decoder.prefill(ids)
    start = time.perf_counter()
    token = torch.tensor(0)
    for _ in range(new):
        token = decoder.step(token).argmax()
    return new / (time.perf_counter() - start)


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/online_hadamard.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = lq.quantize(LlamaForCausalLM(LlamaConfig(**SHAPE)).eval(), lq.RTN(), lq.W8A8, progress=False)
    downs = [block.mlp.down_proj for block in model.model.layers]
    signs, odd = rotation_factors(1536, seed=0)
    transforms = [HadamardTransform(signs, odd) for _ in downs]
    operators = {}
    for rows in (1, 512):
        x = torch.randn(rows, 1536)
        operators[rows] = {"transform_native_ms": median_ms(lambda x=x: hadamard_transform(x, signs.float(),
                                                                                         odd.float())),
                           "transform_pytorch_ms": median_ms(lambda x=x: hadamard_reference(x, signs.float(),
                                                                                          odd.float())),
                           "down_proj_w8a8_ms": median_ms(lambda x=x: downs[0](x))}
        print(f"{rows:3d} rows x 1536: " + "  ".join(f"{k} {v:.3f}" for k, v in operators[rows].items()))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    speeds: dict[str, list[float]] = {"without": [], "with": []}
    decode_tokens_per_s(model, ids, 4)  # warm-up: kernels chosen, operators loaded
    for _ in range(args.rounds):
        for setting in ("without", "with"):
            for layer, transform in zip(downs, transforms, strict=True):
                layer.input_transform = None
                if setting == "with":
                    attach_input_transform(layer, transform)
            speeds[setting].append(decode_tokens_per_s(model, ids, args.new_tokens))
            print(f"decode {setting} the transform: {speeds[setting][-1]:.2f} tokens/s", flush=True)
    medians = {k: statistics.median(v) for k, v in speeds.items()}
    cost = 100 * (1 - medians["with"] / medians["without"])
    print(f"decode medians: without {medians['without']:.2f}, with {medians['with']:.2f} tokens/s ({cost:+.1f}% "
          "slower with)")
    metrics = {"operators": {str(k): v for k, v in operators.items()}, "decode_tokens_per_s": speeds,
               "decode_median_tokens_per_s": medians, "decode_cost_pct": cost}
    protocol = {"scheme": "w8a8", "runtime": "lean", "prompt_tokens": PROMPT, "new_tokens": args.new_tokens,
                "rounds": args.rounds, "threads": args.threads, "statistic": "median", "weights": "random"}
    write_records(args.out, Record.new("bench", "smollm2-135m shape (random weights)", metrics, protocol))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
