"""Runtime speed of SmolLM2-135M quantized, against transformers fp32 and llama.cpp, in one process.

    python benchmarks/speed.py [--threads 1,2] [--repeats 3] [--max-windows 10] [--out benchmarks/results/speed.json]

Protocol: batch 1, a 128-token prompt (the start of WikiText-2 raw test), 64 greedy new tokens; prefill
also at 512 tokens; `--repeats` interleaved rounds, medians; each thread count measured in turn. Every quantized
model is RTN (no calibration: speed does not depend on the method), its LM head kept in float or quantized W8A16
("+ head"), q/k/v and gate/up fused into one GEMM each (`lq.fuse_shared_inputs`, as `bench` does). The baseline
"fp32" runs on transformers' own forward; every other row on the lean decode loop (runtime/decoder.py), the fp32
model too ("fp32 (lean)"), one quantized model also on transformers' loop, and two on the lean loop with its fused
C++ operators off ("(lean, PyTorch operators)"), so that what the loop, the fused operators and the quantization
gain show apart. How far one-token steps move the logits from one full forward (KL, top-1) is measured with and
without the fused operators. Beside each:
the bytes of weights a decoded token reads, the machine's read bandwidth and the decode speed it allows.
Accuracy: perplexity on the first --max-windows 512-token windows with the kernels the registry measured fastest,
with the integer operators at every row count, and with the reference kernel forced, to show what speed changes.
llama.cpp (llama-cpp-python, when installed) runs the bundled Q4_1 file and a Q8_0 file exported from our RTN W8
g32 checkpoint, timed the same way (prefill = one eval of the prompt; decode = one eval per token, greedy on its
logits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import llmeasyquant as lq
from llmeasyquant.calibration.data import load_text, tokenize
from llmeasyquant.eval.bench import BenchConfig, bench, memory_bandwidth_gbs, summary_lines
from llmeasyquant.eval.fidelity import kl_sum, top1_matches
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows, make_windows
from llmeasyquant.models.load import bundled_gguf
from llmeasyquant.nn.qlinear import forced_kernel
from llmeasyquant.plan import Plan, Rule
from llmeasyquant.record import Record, write_records

RUNS = (  # (row name, body scheme, LM head scheme or None)
    ("w8a16", "w8a16", None),
    ("w8a16 + head", "w8a16", "w8a16"),
    ("w8a8", "w8a8", None),
    ("w8a8 + head", "w8a8", "w8a16"),
    ("w4a16-g64-asym + head", "w4a16-g64-asym", "w8a16"),
    ("w4a16-g128 + head", "w4a16-g128", "w8a16"),
    ("w4a8-g64-asym + head", "w4a8-g64-asym", "w8a16"),
    ("w4a8-g128 + head", "w4a8-g128", "w8a16"),
)
LOOP_COMPARED = "w8a8 + head"  # also timed on transformers' loop
# Also timed on the lean loop with the fused C++ operators off (runtime "lean-pytorch"), to show their share.
FUSED_COMPARED = ("w8a8 + head", "w4a16-g64-asym + head")
PYTORCH_OPS = " (lean, PyTorch operators)"


def quantized(name: str, body: str, head: str | None) -> torch.nn.Module:
    model, _ = lq.load_model("smollm2-135m")
    plan = Plan.uniform(lq.parse_scheme(body))
    if head is not None:
        plan = Plan((Rule("lm_head", lq.parse_scheme(head)), *plan.rules))
    model = lq.quantize(model, lq.RTN(), plan, progress=False).eval()
    lq.fuse_shared_inputs(model)  # q/k/v and gate/up as one GEMM each (same results, tested bit for bit)
    return model


def _chosen_kernels(model: torch.nn.Module) -> dict[int, list[str]]:
    """Which kernels ran at each row count over all layers (measured per shape: decode and prefill may differ)."""
    chosen: dict[int, set[str]] = {}
    for layer in (m for m in model.modules() if isinstance(m, lq.QuantLinear)):
        for rows, kernel in layer.chosen_kernels().items():
            chosen.setdefault(rows, set()).add(kernel)
    return {rows: sorted(names) for rows, names in sorted(chosen.items())}


def _forget(model: torch.nn.Module) -> None:
    for layer in (m for m in model.modules() if isinstance(m, lq.QuantLinear)):
        layer.forget_kernel()


def accuracy(models: dict[str, torch.nn.Module], windows: EvalWindows) -> dict[str, dict]:
    """Perplexity with the kernels the registry measured fastest, with the integer operators at every row count
    (the registry's fixed order: what decode runs), and with the reference kernel forced, per model."""
    fast = evaluate_windows(models, windows, reference="fp32")
    found = {name: {"ppl": m["ppl"], "kld": m["kld"], "top1": m["top1"]} for name, m in fast.items()}
    for name, model in models.items():
        if name == "fp32":
            continue
        found[name]["kernels_by_rows"] = _chosen_kernels(model)
        os.environ["LLMEASYQUANT_KERNEL_CHOICE"] = "first"
        _forget(model)
        try:
            found[name]["ppl_integer_kernels"] = evaluate_windows({name: model}, windows, progress=False)[name]["ppl"]
        finally:
            del os.environ["LLMEASYQUANT_KERNEL_CHOICE"]
            _forget(model)
        with forced_kernel(model, "reference"):
            found[name]["ppl_reference_kernel"] = evaluate_windows({name: model}, windows, progress=False)[name]["ppl"]
    return found


@torch.no_grad()
def decode_agreement(model: torch.nn.Module, ids: torch.Tensor, prompt_tokens: int = 128) -> dict[str, float]:
    """How far one-token decode steps move the logits from one full forward over the same text (transformers'
    loop, the kernels its row count selects): teacher-forced steps over ids [T] after a `prompt_tokens` prefill, on
    the lean loop with the fused operators and without them. Mean KL(full || step) and top-1 agreement."""
    full = torch.log_softmax(model(ids[None]).logits[0, prompt_tokens - 1 : -1].float(), dim=-1)
    found = {}
    for label, fused in (("fused", True), ("pytorch", False)):
        decoder = lq.LeanDecoder(model, ids.shape[0], fused=fused)
        logits = [decoder.prefill(ids[:prompt_tokens])] + [decoder.step(t) for t in ids[prompt_tokens:-1]]
        steps = torch.log_softmax(torch.stack(logits).float(), dim=-1)
        found[f"decode_kl_{label}"] = kl_sum(full, steps) / full.shape[0]
        found[f"decode_top1_{label}"] = top1_matches(full, steps) / full.shape[0]
    return found


def llama_cpp_speed(path: Path, prompt: list[int], long_prompt: list[int], new_tokens: int, threads: int,
                    repeats: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          logits_all=False, verbose=False)

    def prefill(ids: list[int]) -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        return len(ids) / (time.perf_counter() - start)

    def decode() -> float:
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return (new_tokens - 1) / (time.perf_counter() - start)

    prefill(prompt[:8])  # warm-up
    runs = [(prefill(prompt), prefill(long_prompt), decode()) for _ in range(repeats)]
    return {"prefill_tok_s": statistics.median(r[0] for r in runs),
            "prefill_long_tok_s": statistics.median(r[1] for r in runs),
            "decode_tok_s": statistics.median(r[2] for r in runs), "decode_tok_s_runs": [r[2] for r in runs]}


def gguf_files(scratch: Path) -> dict[str, Path]:
    """llama.cpp's inputs: the bundled Q4_1 file, and Q8_0 exported (losslessly) from our RTN W8 g32 weights."""
    model = quantized("w8-g32", "w8a16-g32", None)
    folder = lq.save(model, scratch / "w8-g32", lq.load_model("smollm2-135m")[1])
    q8 = lq.export(folder, "gguf", scratch / "w8-g32.gguf").path
    return {"llama.cpp Q4_1 (bundled)": bundled_gguf(), "llama.cpp Q8_0 (our RTN W8 g32)": Path(q8)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-windows", type=int, default=10)
    parser.add_argument("--runs", help="comma-separated indexes into RUNS (default: all)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speed.json"))
    args = parser.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    runs = [RUNS[int(i)] for i in args.runs.split(",")] if args.runs else list(RUNS)
    base, tokenizer = lq.load_model("smollm2-135m")
    source = load_text("wikitext2")
    prompt = tokenize(tokenizer, source.text)[:512].reshape(1, 512)
    models = {"fp32": base.eval(), **{name: quantized(name, body, head) for name, body, head in runs}}
    # The same objects again under another loop: their quality is the same, so it is measured once.
    same_as = {"fp32 (lean)": "fp32", f"{LOOP_COMPARED} (transformers loop)": LOOP_COMPARED,
               **{name + PYTORCH_OPS: name for name in FUSED_COMPARED}}
    runtimes = {"fp32": "transformers", f"{LOOP_COMPARED} (transformers loop)": "transformers",
                **{name + PYTORCH_OPS: "lean-pytorch" for name in FUSED_COMPARED}}
    timed = {"fp32": models["fp32"], "fp32 (lean)": models["fp32"], **{k: v for k, v in models.items() if k != "fp32"}}
    if LOOP_COMPARED in models:
        timed[f"{LOOP_COMPARED} (transformers loop)"] = models[LOOP_COMPARED]
    timed |= {name + PYTORCH_OPS: models[name] for name in FUSED_COMPARED if name in models}
    config = BenchConfig(threads=threads, repeats=args.repeats)
    rows = bench(timed, prompt, config, baseline="fp32", runtimes=runtimes)
    print("\n".join(summary_lines(rows)))
    windows = make_windows(tokenizer, source, 512, args.max_windows)
    quality = accuracy(models, windows)
    for name, model in models.items():
        quality[name] |= decode_agreement(model, prompt[0, :192])
    for row in rows:
        row |= quality[same_as.get(row["model"], row["model"])]
    llama_rows = []
    try:
        import llama_cpp  # noqa: F401
        have_llama = not args.no_llama_cpp
    except ImportError:
        have_llama = False
    if have_llama:
        with tempfile.TemporaryDirectory() as scratch:
            for name, path in gguf_files(Path(scratch)).items():
                for count in threads:
                    base_row = next(r for r in rows if r["model"] == "fp32" and r["threads"] == count)
                    speed = llama_cpp_speed(path, prompt[0, :128].tolist(), prompt[0].tolist(), 64, count,
                                            args.repeats)
                    speed |= {"model": name, "threads": count, "file_mb": path.stat().st_size / 2**20,
                              "bandwidth_gbs": memory_bandwidth_gbs()}
                    for key in ("prefill", "prefill_long", "decode"):
                        speed[f"{key}_speedup"] = speed[f"{key}_tok_s"] / base_row[f"{key}_tok_s"]
                    llama_rows.append(speed)
                    print(f"{name:36s} {count} threads: prefill {speed['prefill_tok_s']:.1f} tok/s "
                          f"(x{speed['prefill_speedup']:.2f}), 512: {speed['prefill_long_tok_s']:.1f} "
                          f"(x{speed['prefill_long_speedup']:.2f}), decode {speed['decode_tok_s']:.1f} tok/s "
                          f"(x{speed['decode_speedup']:.2f})")
    for row in rows:
        if "ppl_reference_kernel" not in row:
            continue
        print(f"{row['model']:24s} {row['threads']} thr: ppl {row['ppl']:.4f} (integer kernels "
              f"{row['ppl_integer_kernels']:.4f}, reference kernel {row['ppl_reference_kernel']:.4f}), "
              f"decode x{row['decode_speedup']:.2f}; kernels by rows {row['kernels_by_rows']}; decode steps vs one "
              f"forward: KL {row['decode_kl_fused']:.5f} fused, {row['decode_kl_pytorch']:.5f} PyTorch operators")
    protocol = {"batch": 1, "prompt": f"first tokens of {source.description}", "prompt_tokens": 128,
                "new_tokens": 64, "prefill_tokens": 512, "repeats": args.repeats, "threads": list(threads),
                "greedy": True, "accuracy_windows": windows.protocol}
    write_records(args.out, Record.new("bench", "smollm2-135m", {"rows": rows, "llama_cpp": llama_rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
