"""GPU benchmark of the Triton kernels against cuBLAS, on linear shapes of a hidden-4096 model.

    python benchmarks/triton_gemm.py [--out benchmarks/results/triton_gemm.json] [--iters 50] [--warmup 10]

For each token count M and weight shape K x N (in x out): our Triton W8A8 (per-token activation quantization
kernel + int8 GEMM), `torch._int_mm` with the same quantization in PyTorch ops, bf16 and fp16 `torch.matmul`
(cuBLAS), and our Triton W4A16 (group 128, asymmetric, fp16 activations). Each shape is first checked against the
reference kernel (and the W8A8 activation codes against primitives.quantize). Times are medians over `--iters`
calls timed with CUDA events after `--warmup` calls (which also run the autotuner), with L2 flushed before each
call unless `--no-flush`; TFLOPS count 2 M N K; ratios are bf16 time / kernel time (above 1: faster than bf16).
Needs a CUDA GPU and triton (`pip install -e '.[gpu]'`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("triton_gemm")

TOKENS = (1, 16, 512, 2048, 4096)
# (K, N) = (in, out): o_proj/q_proj, gate/up, down, fused qkv of a hidden-4096, intermediate-11008 model.
SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288))
W4_SCHEME = "w4a16-g128-asym"


def time_ms(fn: Callable[[], object], warmup: int, iters: int, flush: torch.Tensor | None) -> float:
    """Median milliseconds of fn() between CUDA events; the L2 flush (a memset) happens outside the events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def rel_max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def rel_rms_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def torch_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same per-token symmetric int8 quantization in PyTorch ops (for the torch._int_mm baseline)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp(min=2.0**-24)
    return (xf / scale).round().clamp(-128, 127).to(torch.int8), scale


def bench_shape(k: int, n: int, tokens: list[int], warmup: int, iters: int,
                flush: torch.Tensor | None) -> list[dict]:
    """Rows for one weight shape [n, k]: correctness against the reference, then each kernel's time."""
    from llmeasyquant import QuantLinear, parse_scheme
    from llmeasyquant.kernels.reference import ReferenceKernel
    from llmeasyquant.kernels.triton import w4a16, w8a8
    from llmeasyquant.primitives import quantize

    device = torch.device("cuda")
    reference = ReferenceKernel()
    weight = torch.randn(n, k, device=device) * 0.02
    w8 = QuantLinear.from_weight(weight, None, parse_scheme("w8a8")).to(device)
    w4 = QuantLinear.from_weight(weight, None, parse_scheme(W4_SCHEME)).to(device)
    p8 = w8a8.prepare_weight(w8.qweight, w8.scales, w8.zeros)
    p4 = w4a16.prepare_weight(w4.qweight, w4.scales, w4.zeros, w4.in_features, w4.group_size)
    w_bf16, w_fp16 = weight.t().contiguous().bfloat16(), weight.t().contiguous().half()  # [K, N]
    w_int_mm = p8.w.t()  # [K, N], column-major: the layout cuBLASLt's int8 GEMM wants
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device=device)
        x[:, ::97] *= 8  # a few outlier channels, as LLM activations have
        x_bf16, x_fp16 = x.bfloat16(), x.half()

        # correctness first
        codes_ok = torch.equal(w8a8.quantize_per_token(x_bf16).q,
                               quantize(x_bf16.float(), w8.activation_qparams(x_bf16.float()), 8))
        err8 = rel_max_err(w8a8.w8a8_linear(x_bf16, p8, torch.float32), reference.run(w8, x_bf16.float(), None))
        err4 = rel_rms_err(w4a16.w4a16_matmul(x_fp16, p4, out_dtype=torch.float32),
                           reference.run(w4, x_fp16.float(), None))
        ok = codes_ok and err8 <= 1e-3 and err4 <= 2e-3
        if not ok:
            log.error("M=%d K=%d N=%d: WRONG RESULTS (codes identical %s, w8a8 rel max err %.2e, w4a16 rel rms "
                      "err %.2e)", m, k, n, codes_ok, err8, err4)

        def int_mm(x: torch.Tensor = x_bf16) -> torch.Tensor:
            q, s = torch_quantize_per_token(x)
            return (torch._int_mm(q, w_int_mm).float() * s * p8.scale[None, :]).bfloat16()

        qx = w8a8.quantize_per_token(x_bf16)
        q_torch, _ = torch_quantize_per_token(x_bf16)
        candidates: dict[str, Callable[[], object]] = {
            "bf16_matmul": lambda x=x_bf16: torch.matmul(x, w_bf16),
            "fp16_matmul": lambda x=x_fp16: torch.matmul(x, w_fp16),
            "triton_w8a8": lambda x=x_bf16: w8a8.w8a8_linear(x, p8),
            "triton_w8a8_gemm_only": lambda qx=qx: w8a8.int8_matmul(qx, p8, torch.bfloat16),
            "int_mm_w8a8": int_mm,
            "int_mm_gemm_only": lambda q=q_torch: torch._int_mm(q, w_int_mm),
            "triton_w4a16": lambda x=x_fp16: w4a16.w4a16_matmul(x, p4),
        }
        row: dict = {"M": m, "K": k, "N": n, "verified": ok, "w8a8_codes_identical": codes_ok,
                     "w8a8_rel_max_err": err8, "w4a16_rel_rms_err": err4}
        for name, fn in candidates.items():
            try:
                ms = time_ms(fn, warmup, iters, flush)
            except RuntimeError as exc:  # e.g. torch._int_mm refuses M <= 16
                row[name] = {"ms": None, "error": str(exc).splitlines()[0]}
                continue
            row[name] = {"ms": ms, "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12}
        for name in candidates:
            if row[name]["ms"] is not None:
                row[name]["vs_bf16"] = row["bf16_matmul"]["ms"] / row[name]["ms"]
        row["triton_w8a8_config"] = str(w8a8._int8_gemm_tuned.best_config)
        row["triton_w4a16_config"] = str(w4a16._w4a16_tuned.best_config)
        rows.append(row)
        cells = "  ".join(f"{name} {row[name]['ms']:.3f}ms x{row[name]['vs_bf16']:.2f}"
                          for name in candidates if row[name]["ms"] is not None)
        log.info("M=%-5d K=%-5d N=%-5d %s %s", m, k, n, "ok" if ok else "WRONG", cells)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/triton_gemm.json"))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--no-flush", action="store_true", help="keep L2 warm between calls (inflates small-M speed)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if not torch.cuda.is_available():
        print("benchmarks/triton_gemm.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}). Run it on a GPU machine with a CUDA build of torch and "
              "`pip install -e '.[gpu]'`.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("benchmarks/triton_gemm.py needs triton: pip install -e '.[gpu]'", file=sys.stderr)
        return 2
    from llmeasyquant.record import Record, write_records

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.manual_seed(0)
    flush = None if args.no_flush else torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    rows = []
    for k, n in SHAPES:
        rows += bench_shape(k, n, args.tokens, args.warmup, args.iters, flush)
        torch.cuda.empty_cache()
    failures = [[row["M"], row["K"], row["N"]] for row in rows if not row["verified"]]

    protocol = {"iters": args.iters, "warmup": args.warmup, "statistic": "median of CUDA-event times",
                "l2_flushed": flush is not None, "x_dtype": "bf16 (fp16 for fp16_matmul and triton_w4a16)",
                "outputs": "bf16 (fp16 for fp16_matmul and triton_w4a16)", "w4a16_scheme": W4_SCHEME,
                "w8a8_scheme": "w8a8 (dynamic per-token symmetric int8 activations, per-channel int8 weights)",
                "tflops": "2*M*N*K / time", "vs_bf16": "bf16_matmul time / kernel time"}
    gpu = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__}
    metrics = {"gpu": gpu, "rows": rows, "failures": failures}
    write_records(args.out, Record.new("bench", "synthetic hidden-4096 linear shapes", metrics, protocol))
    log.info("wrote %s", args.out)
    if failures:
        log.error("%d case(s) gave wrong results (M, K, N): %s", len(failures), failures)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
