"""llm-compressor under the house protocol, for the peer rows of docs/RESULTS.md (not part of CI).

    .venv-peers/bin/python benchmarks/peers/llm_compressor.py [--max-windows 40] [--runs rtn-w8a8,sq-w8a8,...]

Same model (SmolLM2-135M from the bundled GGUF), same calibration chunks (first 64 consecutive 512-token chunks of
WikiText-2 validation, unshuffled), same evaluation windows and the same "unit" (an 8-window fp32 evaluation
timed in this process just before quantizing) as benchmarks/methods.py. Its quantized model is evaluated in
memory (llm-compressor's own fake-quantized forward), and its checkpoint size is that of `save_pretrained`.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids, load_text
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows, make_windows
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table


def recipes() -> dict[str, list]:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    w4_g64 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                              "strategy": "group", "group_size": 64}}}
    return {
        "rtn-w8a8": [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])],
        "sq0.8-rtn-w8a8": [SmoothQuantModifier(smoothing_strength=0.8),
                           QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])],
        "sq0.8-gptq-w8a8": [SmoothQuantModifier(smoothing_strength=0.8),
                            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])],
        "gptq-w4a16-g64": [GPTQModifier(config_groups=w4_g64, ignore=["lm_head"])],
    }


def main() -> int:
    from datasets import Dataset
    from llmcompressor import oneshot

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-windows", type=int, default=40)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--runs", help="comma-separated run names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peers_llm_compressor.json"))
    args = parser.parse_args()
    base, tokenizer = lq.load_model("smollm2-135m")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    calib, _ = calibration_ids("wikitext2", base, tokenizer, args.calib_samples, 512)
    dataset = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    table = recipes()
    names = args.runs.split(",") if args.runs else list(table)
    rows = []
    for name in names:
        unit_s = evaluate_windows({"fp32": base}, EvalWindows(windows.ids[:8], windows.protocol),
                                  progress=False)["fp32"]["eval_s"]
        model = copy.deepcopy(base)
        start = time.perf_counter()
        oneshot(model=model, dataset=dataset, recipe=table[name], max_seq_length=512,
                num_calibration_samples=args.calib_samples, shuffle_calibration_samples=False)
        seconds = time.perf_counter() - start
        metrics = evaluate_windows({"fp32": base, name: model}, windows, reference="fp32", progress=False)[name]
        with tempfile.TemporaryDirectory() as scratch:
            model.save_pretrained(scratch, save_compressed=True)
            size = sum(f.stat().st_size for f in Path(scratch).glob("*.safetensors"))
        rows.append({"method": f"llm-compressor {name}", **metrics, "quantize_s": seconds,
                     "quantize_units": seconds / unit_s, "checkpoint_mb": size / 2**20})
    write_records(args.out, Record.new("peers_llm_compressor", "smollm2-135m", {"rows": rows},
                                       {**windows.protocol, "calib_samples": args.calib_samples, "calib_seqlen": 512},
                                       command=" ".join(["python", *sys.argv])))
    print(markdown_table(rows, (("method", "method", ""), ("ppl", "ppl", ".3f"), ("KL", "kld", ".5f"),
                                ("quant s", "quantize_s", ".1f"), ("units", "quantize_units", ".1f"),
                                ("ckpt MB", "checkpoint_mb", ".1f"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
