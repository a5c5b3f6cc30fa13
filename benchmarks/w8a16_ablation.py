"""Where W8A16's top-1 disagreement comes from: weights, kernel, fp16 storage, or the scale rule.

    python benchmarks/w8a16_ablation.py [--max-windows 10] [--out benchmarks/results/w8a16_ablation.json]

All variants are evaluated against the fp32 model on the same WikiText-2 windows in one pass.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

import llmeasyquant as lq
from llmeasyquant.api import round_unquantized_to_fp16
from llmeasyquant.calibration.data import load_text
from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
from llmeasyquant.record import Record, write_records


def rtn(base: torch.nn.Module, keep_fp32: bool, kernel: str | None = None) -> torch.nn.Module:
    model = lq.quantize(copy.deepcopy(base), lq.RTN(), lq.W8A16, keep_fp32=keep_fp32, progress=False)
    for layer in model.modules():
        if isinstance(layer, lq.QuantLinear):
            layer.kernel_name = kernel
    return model


def mse_scaled_int8(base: torch.nn.Module) -> torch.nn.Module:
    """Float model whose block linears hold int8 per-channel values with each row's clip ratio searched (0.5-1)."""
    model = copy.deepcopy(base)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            w = module.weight.detach()
            best, best_err = None, None
            for ratio in torch.linspace(1.0, 0.5, 51).tolist():
                scale = w.abs().amax(1, keepdim=True) * ratio / 127
                q = (w / scale).round().clamp(-127, 127) * scale
                err = (q - w).pow(2).sum(1, keepdim=True)
                if best is None:
                    best, best_err = q, err
                else:
                    better = err < best_err
                    best, best_err = torch.where(better, q, best), torch.where(better, err, best_err)
            module.weight.data.copy_(best)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-windows", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/w8a16_ablation.json"))
    args = parser.parse_args()
    base, tokenizer = lq.load_model("smollm2-135m")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    fp16_storage = copy.deepcopy(base)
    round_unquantized_to_fp16(fp16_storage)
    models = {
        "fp32": base,
        "w8a16 int kernel (bf16 act), fp16 storage": rtn(base, keep_fp32=False),
        "w8a16 int kernel (bf16 act), fp32 storage": rtn(base, keep_fp32=True),
        "w8a16 reference kernel (fp32), fp32 storage": rtn(base, keep_fp32=True, kernel="reference"),
        "w8a16 MSE-searched scales, fp32 compute": mse_scaled_int8(base),
        "fp32 with embeddings/norms rounded to fp16": fp16_storage,
        "whole model in bf16": copy.deepcopy(base).to(torch.bfloat16),
    }
    metrics = evaluate_windows(models, windows, reference="fp32")
    print("| variant | ppl | KL | top-1 % |\n|---|---|---|---|")
    for name, m in metrics.items():
        print(f"| {name} | {m['ppl']:.3f} | {m['kld']:.5f} | {100 * m['top1']:.2f} |")
    write_records(args.out, Record.new("eval", "smollm2-135m", metrics, windows.protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
