"""The fused C++ decode operators (kernels/native.py) against the PyTorch operators they replace, and the decode
paths that use them against the paths that do not."""

from __future__ import annotations

import shutil
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from tests.kernels.test_grid_kernels import GRID_SCHEMES
from tests.runtime.test_decoder import FAMILIES, family_model, prompt

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.kernels import candidates, native
from llmeasyquant.kernels.cpu import quantize_rows_symmetric
from llmeasyquant.models.arch import rotate_half as _rotate_half
from llmeasyquant.nn.qlinear import forced_kernel
from llmeasyquant.primitives import MIN_SCALE, choose_qparams, qrange, quantize
from llmeasyquant.scheme import PerToken

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler on this machine: the fused operators cannot be built, decoding runs on PyTorch "
                "operators", allow_module_level=True)


def rows(count: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("count", [1, 3, 16, 513])  # 513: a prompt's rows, split over the threads
@pytest.mark.parametrize("width", [64, 576, 1000])
def test_quantize_rows_is_bit_identical(ops, count, width, bits):
    qmax = 2 ** (bits - 1) - 1
    x = rows(count, width)
    x[0, :5] = torch.tensor([0.5, -0.5, 1.5, -2.5, 0.0]) * x[0].abs().max() / qmax  # ties: rounded to even
    if count > 1:
        x[1] = 0.0  # an all-zero row takes the minimum scale
    codes, scales = ops.quantize_rows(x, MIN_SCALE, qmax)
    expected_codes, expected_scales = quantize_rows_symmetric(x, bits)
    assert int(codes.abs().max()) == qmax
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales, expected_scales)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("count", [1, 3, 16, 513])
@pytest.mark.parametrize("width", [64, 576, 1000])
def test_asymmetric_quantize_rows_is_bit_identical(ops, count, width, bits):
    """The fused asymmetric quantizer gives choose_qparams' scales and zero points and quantize's codes exactly:
    mixed, all-positive (zero point at qmin), all-negative and all-zero rows, and values on rounding ties."""
    qmin, qmax = qrange(bits)
    x = rows(count, width, seed=width + count)
    if count > 2:
        x[0] = x[0].abs() + 0.25
        x[1] = -x[1].abs()
        x[2] = 0.0
    lo, hi = float(x[-1].min()), float(x[-1].max())
    x[-1, :3] = torch.tensor([lo, hi, lo + (hi - lo) / (qmax - qmin) * 2.5])  # a tie between two codes
    codes, scales, zeros = ops.quantize_rows_asym(x, MIN_SCALE, qmin, qmax)
    qp = choose_qparams(x, bits, False, PerToken(), scale_dtype=None)
    assert torch.equal(scales, qp.scale) and torch.equal(zeros, qp.zero)
    assert torch.equal(codes, quantize(x, qp, bits))
    assert int(codes.min()) == qmin or int(codes.max()) == qmax
    with pytest.raises(RuntimeError, match="code range"):
        ops.quantize_rows_asym(x, MIN_SCALE, 0, qmax)


@pytest.mark.parametrize("count", [4, 300])
def test_dequantize_rows_is_bit_identical(ops, count):
    acc = torch.randint(-2**24, 2**24, (count, 300), dtype=torch.int32)
    row_scales, column_scales = torch.rand(count, 1), torch.rand(300)
    assert torch.equal(ops.dequantize_rows(acc, row_scales, column_scales), torch.mul(acc, row_scales) * column_scales)


@pytest.mark.parametrize("count", [3, 300])
def test_rms_norm_and_gate_mul_match_pytorch(ops, count):
    x, weight = rows(count, 576), torch.randn(576)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (576,), weight, 1e-6))
    gate_up = rows(count, 2 * 96) * 3  # gates out to where GELU's tanh saturates
    gate, up = gate_up.chunk(2, dim=-1)
    assert set(ops.GATE_ACTIVATIONS) == {"silu", "gelu_tanh"}
    torch.testing.assert_close(ops.gate_mul(gate_up, ops.GATE_ACTIVATIONS["silu"]), F.silu(gate) * up)
    torch.testing.assert_close(ops.gate_mul(gate_up, ops.GATE_ACTIVATIONS["gelu_tanh"]),
                               F.gelu(gate, approximate="tanh") * up)
    with pytest.raises(RuntimeError, match="unknown gate activation"):
        ops.gate_mul(gate_up, len(ops.GATE_ACTIVATIONS))
    torch.testing.assert_close(ops.rms_norm(x.t().contiguous().t(), weight, 1e-6), ops.rms_norm(x, weight, 1e-6))


def test_operators_let_other_threads_run_python(ops):
    """A native call releases the GIL: another thread runs Python all through it. (Held, that thread could run only
    about a switch interval at each end of the timed window: before the call, and after it, before the caller has
    the GIL back to read the clock; so the middle half of a window of eight intervals and more is what counts.)"""
    width, interval = 4096, sys.getswitchinterval()
    x, weight = rows(1, width).expand(12_000, width).contiguous(), torch.randn(width)
    stamps: list[float] = []
    done = threading.Event()

    def count() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core for the counting thread
    worker = threading.Thread(target=count)
    try:
        worker.start()
        while True:
            start = time.perf_counter()
            ops.rms_norm(x, weight, 1e-6)
            end = time.perf_counter()
            if end - start > 8 * interval:
                break
            x = torch.cat([x, x])  # a faster machine: a longer call
    finally:
        done.set()
        worker.join(timeout=10)
        torch.set_num_threads(threads)
    quarter = (end - start) / 4
    middle = [t for t in stamps if start + quarter < t < end - quarter]
    assert len(middle) > 100, f"{len(middle)} steps of the other thread in the middle of a {end - start:.3f} s call"


@pytest.mark.parametrize("count", [1, 70])
@pytest.mark.parametrize("with_norms", [False, True])
def test_rope_store_rotates_and_writes_the_cache(ops, with_norms, count):
    heads, kv_heads, dim, max_tokens, pos = 6, 2, 16, 80, 7
    qkv = rows(count, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(count, dim), torch.randn(count, dim)
    keys, values = torch.zeros(kv_heads, max_tokens, dim), torch.zeros(kv_heads, max_tokens, dim)
    q_norm, k_norm = (torch.randn(dim), torch.randn(dim)) if with_norms else (None, None)
    queries = ops.rope_store(qkv, cos, sin, keys, values, pos, heads, q_norm, k_norm, 1e-6, 1e-5)

    qk = qkv[:, : (heads + kv_heads) * dim].view(count, heads + kv_heads, dim)
    if with_norms:
        qk = torch.cat((F.rms_norm(qk[:, :heads], (dim,), q_norm, 1e-6),
                        F.rms_norm(qk[:, heads:], (dim,), k_norm, 1e-5)), dim=1)
    qk = qk * cos[:, None] + _rotate_half(qk) * sin[:, None]
    end = pos + count
    torch.testing.assert_close(queries, qk[:, :heads])
    torch.testing.assert_close(keys[:, pos:end], qk[:, heads:].transpose(0, 1))
    assert torch.equal(values[:, pos:end], qkv[:, (heads + kv_heads) * dim:].view(count, kv_heads, dim).transpose(0, 1))
    assert keys[:, :pos].abs().sum() == 0 and values[:, end:].abs().sum() == 0  # nothing else written
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_store(qkv, cos, sin, keys, values, max_tokens - count + 1, heads, None, None, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope_store(qkv, cos[:, :-1], sin, keys, values, pos, heads, None, None, 0.0, 0.0)


def sdpa_over_cache(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                    scale: float) -> torch.Tensor:
    """PyTorch's attention of queries [T, heads, dim] at positions start.. over the cache's first start + T
    positions, causal: [T, heads * dim]."""
    count, end = queries.shape[0], start + queries.shape[0]
    mask = torch.ones(count, end, dtype=torch.bool).tril(diagonal=start)
    out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys[None, :, :end], values[None, :, :end],
                                         attn_mask=mask, scale=scale, enable_gqa=True)  # [1, heads, T, dim]
    return out[0].transpose(0, 1).reshape(count, -1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (8, 2, 80), (4, 1, 128)])
@pytest.mark.parametrize(("count", "start"), [(2, 0), (64, 0), (200, 0), (513, 0), (7, 30), (150, 300)])
def test_causal_attention_matches_sdpa(ops, heads, kv_heads, dim, count, start):
    queries = rows(count * heads, dim, seed=1).view(count, heads, dim)
    keys, values = rows(kv_heads * 600, dim, seed=2).view(kv_heads, 600, dim), torch.randn(kv_heads, 600, dim)
    found = ops.causal_attention(queries, keys, values, start, dim**-0.5)
    torch.testing.assert_close(found, sdpa_over_cache(queries, keys, values, start, dim**-0.5), atol=1e-5, rtol=1e-4)


def test_causal_attention_without_blas_computes_the_same(ops):
    """Where PyTorch's build exports no BLAS GEMM, the operator runs its GEMMs through at::mm."""
    queries = rows(100 * 9, 64, seed=1).view(100, 9, 64)
    keys, values = rows(3 * 200, 64, seed=2).view(3, 200, 64), torch.randn(3, 200, 64)
    assert ops.use_blas(True), "PyTorch's x86 build exports its BLAS GEMM; the fast path must be the one tested"
    with_blas = ops.causal_attention(queries, keys, values, 50, 0.125)
    try:
        assert not ops.use_blas(False)
        torch.testing.assert_close(ops.causal_attention(queries, keys, values, 50, 0.125), with_blas,
                                   atol=1e-5, rtol=1e-4)
    finally:
        ops.use_blas(True)
    torch.testing.assert_close(with_blas, sdpa_over_cache(queries, keys, values, 50, 0.125), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (8, 2, 80), (4, 1, 128)])
@pytest.mark.parametrize("length", [1, 37, 700])
def test_decode_attention_matches_sdpa(ops, heads, kv_heads, dim, length):
    queries = rows(heads, dim, seed=1)
    keys, values = rows(kv_heads * 800, dim, seed=2).view(kv_heads, 800, dim), torch.randn(kv_heads, 800, dim)
    found = ops.decode_attention(queries, keys, values, length, dim**-0.5)
    expected = F.scaled_dot_product_attention(queries[None, :, None], keys[None, :, :length], values[None, :, :length],
                                              scale=dim**-0.5, enable_gqa=True)  # [1, heads, 1, dim]
    assert found.shape == (1, heads * dim)
    torch.testing.assert_close(found, expected.reshape(1, heads * dim), atol=1e-5, rtol=1e-4)


def test_bad_inputs_are_refused(ops):
    with pytest.raises(RuntimeError, match="must be Float"):
        ops.rms_norm(torch.zeros(1, 8, dtype=torch.float16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="rows of 8 values"):
        ops.rms_norm(torch.zeros(1, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="do not group"):
        ops.decode_attention(torch.zeros(3, 16), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), 2, 1.0)
    with pytest.raises(RuntimeError, match="do not group"):
        ops.causal_attention(torch.zeros(2, 3, 16), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), 0, 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.causal_attention(torch.zeros(3, 2, 16), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), 2, 1.0)
    with pytest.raises(RuntimeError, match="must be \\[rows, heads, dim\\]"):
        ops.causal_attention(torch.zeros(3, 32), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), 0, 1.0)


# Gemma's MLP runs GELU, which the fused operators (SiLU) do not compute: its decoder runs PyTorch's operators.
@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if f != "gemma"))
def test_fused_runs_match_pytorch_runs(ops, family):
    """A 70-token prompt (two query blocks of the causal attention), a chunk after it, then one-token steps."""
    model = family_model(family)
    ids = prompt(90, seed=4)
    found = {}
    for fused in (True, False):
        decoder = LeanDecoder(model, 100, fused=fused)
        assert (decoder.fused_ops is not None) == fused
        logits = [decoder.prefill(ids[:, :70]), decoder.prefill(ids[:, 70:])]
        logits += [decoder.step(torch.tensor(t)) for t in (5, 17, 250, 3, 99)]
        found[fused] = torch.stack(logits)
    torch.testing.assert_close(found[True], found[False], atol=2e-5, rtol=1e-4)


def test_fused_steps_are_refused_where_not_covered(ops, monkeypatch):
    model = family_model("llama")
    model.config.hidden_act = "gelu"  # GELU's exact (erf) form: they compute SiLU and GELU's tanh form
    assert LeanDecoder(model, 8).fused_ops is None
    assert LeanDecoder(family_model("gemma"), 8).fused_ops is not None  # gelu_pytorch_tanh by its config
    monkeypatch.setenv("LLMEASYQUANT_NATIVE", "0")
    assert native.ops() is None
    assert LeanDecoder(family_model("llama"), 8).fused_ops is None


@pytest.mark.parametrize("count", [1, 5, 16, 17])
def test_w8a8_kernel_is_bit_identical_with_and_without_them(ops, monkeypatch, count):
    model = lq.quantize(family_model("llama"), lq.RTN(), lq.parse_scheme("w8a8"), progress=False)
    layer = model.model.layers[0].mlp.down_proj
    x = rows(count, layer.in_features)
    with forced_kernel(model, "cpu_int_mm_w8a8"), torch.no_grad():
        fused = layer(x)
        monkeypatch.setenv("LLMEASYQUANT_NATIVE", "0")
        assert torch.equal(layer(x), fused)


def exact_int_product(qx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (qx.long() @ q.long().t()).int()  # int64 sums: exact, and they fit int32 at these widths


@pytest.mark.parametrize(("width", "out_features"), [(64, 4), (100, 7), (576, 192), (1000, 33), (4097, 9)])
@pytest.mark.parametrize("count", [1, 3, 4, 5, 9])
def test_int8_int8_matmul_is_the_exact_integer_product_scaled(ops, width, out_features, count):
    """Codes over the whole int8 range (-128 included, where the unsigned offset of the VNNI path matters), widths
    that are not multiples of 64 (masked tails), channels not a multiple of 4 and rows around the 4 that share loads."""
    gen = torch.Generator().manual_seed(width + count)
    qx = torch.randint(-128, 128, (count, width), dtype=torch.int8, generator=gen)
    q = torch.randint(-128, 128, (out_features, width), dtype=torch.int8, generator=gen)
    x_scales, w_scales = torch.rand(count, 1, generator=gen), torch.rand(out_features, generator=gen)
    found = ops.int8_int8_matmul(qx, x_scales, q, w_scales, q.sum(dim=1, dtype=torch.int32))
    assert torch.equal(found, torch.mul(exact_int_product(qx, q), x_scales) * w_scales)


def test_int8_int8_matmul_holds_the_largest_sums(ops):
    width = 8192  # every product at its extreme: the unsigned-offset lanes at their largest, no overflow
    qx = torch.full((2, width), -128, dtype=torch.int8)
    qx[1] = 127
    q = torch.stack([torch.full((width,), -128, dtype=torch.int8), torch.full((width,), 127, dtype=torch.int8)])
    found = ops.int8_int8_matmul(qx, torch.ones(2, 1), q, torch.ones(2), q.sum(dim=1, dtype=torch.int32))
    assert torch.equal(found, exact_int_product(qx, q).float())


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (100, 7), (1536, 33)])
@pytest.mark.parametrize("count", [1, 4, 6, 16, 17])
def test_native_w8a8_kernel_gives_the_bits_of_torch_int_mm(ops, in_features, out_features, count):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3)) * 0.05
    layer = lq.QuantLinear.from_weight(weight, torch.randn(out_features), lq.parse_scheme("w8a8"))
    assert [k.name for k in candidates(layer)] == ["cpu_int_mm_w8a8", "cpu_native_w8a8", "cpu_fp32_w8a8"]
    x = rows(count, in_features)
    x[:, ::13] *= 5
    found = {}
    for kernel in ("cpu_native_w8a8", "cpu_int_mm_w8a8", "reference"):
        with forced_kernel(layer, kernel), torch.no_grad():
            found[kernel] = layer(x)
    assert torch.equal(found["cpu_native_w8a8"], found["cpu_int_mm_w8a8"])
    assert torch.equal(found["cpu_native_w8a8"], found["reference"])
    with pytest.raises(RuntimeError, match="share in"):
        ops.int8_int8_matmul(torch.zeros(1, in_features - 1, dtype=torch.int8), torch.ones(1, 1), layer.qweight,
                             torch.ones(out_features), torch.zeros(out_features, dtype=torch.int32))


@pytest.mark.parametrize("scheme", ["w8a8-asym", "w8a8-aasym", "w8a8-apt-aasym", "w8a16"])
def test_native_w8a8_kernel_is_offered_only_for_symmetric_per_token_codes(ops, scheme):
    layer = lq.QuantLinear.from_weight(torch.randn(8, 64), None, lq.parse_scheme(scheme))
    assert "cpu_native_w8a8" not in [k.name for k in candidates(layer)]


def test_lean_pytorch_runtime_steps_without_them(ops):
    from llmeasyquant.eval.speed import Greedy

    model, ids = family_model("llama"), prompt(12)
    chosen = {}
    for runtime in ("lean", "lean-pytorch"):
        run = Greedy(model, runtime, 20)
        assert (run.decoder.fused_ops is not None) == (runtime == "lean")
        tokens = [run.prefill(ids)]
        tokens += [run.step(tokens[-1]) for _ in range(6)]
        chosen[runtime] = torch.stack(tokens)
    assert torch.equal(chosen["lean"], chosen["lean-pytorch"])


@pytest.mark.parametrize("scheme", ["w8a16", "w8a16-asym", "w8a16-pt"])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (100, 7), (48, 1)])
@pytest.mark.parametrize("count", [1, 3, 40])
def test_int8_weight_matmul_kernel_matches_the_reference_in_fp32(ops, scheme, in_features, out_features, count):
    """W8A16 on the fused int8-weight matmul: the registry's first choice, any width, equal to the dequantize-GEMM
    reference to fp32 rounding (PyTorch's int8 operator is 1e-3 away: bf16 activations and outputs)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5)) * 0.05
    layer = lq.QuantLinear.from_weight(weight, torch.randn(out_features), lq.parse_scheme(scheme))
    assert [k.name for k in candidates(layer)][:1] == ["cpu_native_w8a16"]
    x = rows(count, in_features)
    with forced_kernel(layer, "cpu_native_w8a16"), torch.no_grad():
        found = layer(x)
    with forced_kernel(layer, "reference"), torch.no_grad():
        expected = layer(x)
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="share in"):
        ops.int8_weight_matmul(x[:, :-1], layer.qweight, torch.ones(out_features))


def test_a_chosen_native_kernel_survives_the_switch_turned_off(ops, monkeypatch):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    layer = lq.QuantLinear.from_weight(weight, None, lq.parse_scheme("w8a16"))
    x = rows(1, 64)
    with forced_kernel(layer, "cpu_native_w8a16"), torch.no_grad():
        before = layer(x)
        monkeypatch.setenv("LLMEASYQUANT_NATIVE", "0")
        assert torch.equal(layer(x), before)


def forced_and_reference(layer, kernel: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output on x with `kernel` forced, and with the reference kernel."""
    with forced_kernel(layer, kernel), torch.no_grad():
        found = layer(x)
    with forced_kernel(layer, "reference"), torch.no_grad():
        expected = layer(x)
    return found, expected


def int4_layer(scheme: str, in_features: int, out_features: int) -> lq.QuantLinear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(7)) * 0.05
    return lq.QuantLinear.from_weight(weight, torch.randn(out_features), lq.parse_scheme(scheme))


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-pt", "w4a16-g32-asym", "w4a16-g64", "w4a16-g128-asym", "w4a16-g30"])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (100, 7), (1536, 33), (101, 5)])
def test_dequantize_int4_is_the_reference_weight_bit_for_bit(ops, scheme, in_features, out_features):
    layer = int4_layer(scheme, in_features, out_features)
    zeros = layer.zeros.float() if layer.zeros is not None else None
    found = ops.dequantize_int4(layer.qweight, layer.scales.float(), zeros, in_features, layer.group_size)
    assert torch.equal(found, layer.dequantize())


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-g32-asym", "w4a16-g64", "w4a16-g30", "w4a16-g33", *GRID_SCHEMES])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (100, 7), (101, 5)])
@pytest.mark.parametrize("count", [1, 3, 5, 16, 17, 40])
def test_int4_weight_kernel_matches_the_reference_in_fp32(ops, scheme, in_features, out_features, count):
    """W4A16 on the fused operators, uniform codes or a grid's table: the registry's first choice; up to 16 rows
    (weights dequantized in registers) the reference's result to within what carrying the activations at 16
    significant bits can move (the bf16 dot-product path; the grid's table path is fp32), its exact result above
    (the same fp32 weight and GEMM)."""
    layer = int4_layer(scheme, in_features, out_features)
    if layer.group_size % 2 and layer.group_size < in_features:
        assert "cpu_native_w4a16" not in [k.name for k in candidates(layer)]  # an odd group starts mid-byte
        return
    assert [k.name for k in candidates(layer)][:1] == ["cpu_native_w4a16"]
    x = rows(count, in_features)
    found, expected = forced_and_reference(layer, "cpu_native_w4a16", x)
    if count > 16:
        assert torch.equal(found, expected)
    else:
        assert within_split_rounding(found, expected, x, layer.dequantize())


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-g32-asym", "w4a16-g64", "w4a16-g128-asym", "w4a16-g96-asym"])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 19), (2048, 40), (100, 7), (101, 5), (8192, 6)])
@pytest.mark.parametrize("count", [1, 4, 6])
@pytest.mark.parametrize("bf16_dot", [False, True])
def test_both_int4_decode_paths_match_the_reference(ops, scheme, in_features, out_features, count, bf16_dot):
    """The table-lookup path (fp32 activations) and the bf16 dot-product path (activations split into two bf16
    numbers, 16 significant bits) against the reference's fp32 weight and matmul. Sizes cover a last block of 128
    columns cut short (576, 100), an odd width (101, a padding nibble), channel counts that are not multiples of the
    tile of 4, and rows in fours and left over."""
    layer = int4_layer(scheme, in_features, out_features)
    zeros = layer.zeros.float() if layer.zeros is not None else None
    x = rows(count, in_features)
    found = ops.int4_weight_matmul(x, layer.qweight, layer.scales.float(), zeros, layer.group_size, bf16_dot)
    expected = x @ layer.dequantize().t()
    assert within_split_rounding(found, expected, x, layer.dequantize())


def within_split_rounding(found: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """|found - expected| within 2e-5 of sum_i |x_i w_i|, which bounds what rounding x moves a sum by: below 2^-16
    of it for activations split into two bf16 numbers, 2^-24 in fp32, plus the float sums' own rounding."""
    return bool(((found - expected).abs() <= (x.abs() @ weight.abs().t()) * 2e-5 + 1e-6).all())


def test_the_bf16_dot_path_is_built_where_the_cpu_has_it(ops):
    has_it = torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()
    assert ops.bf16_dot_built() == has_it
    if has_it:  # and the flag takes it: the two paths round differently
        layer = int4_layer("w4a16-g128", 2048, 8)
        x = rows(1, 2048)
        paths = [ops.int4_weight_matmul(x, layer.qweight, layer.scales.float(), None, 128, flag) for flag in (0, 1)]
        assert not torch.equal(*paths)


def test_int4_operators_refuse_mismatched_buffers(ops):
    layer = int4_layer("w4a16-g32-asym", 100, 7)
    scales, zeros = layer.scales.float(), layer.zeros.float()
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.int4_weight_matmul(rows(1, 90), layer.qweight, scales, zeros, 32, True)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.dequantize_int4(layer.qweight, scales[:, :2], None, 100, 32)
    with pytest.raises(RuntimeError, match="zeros must match"):
        ops.dequantize_int4(layer.qweight, scales, zeros[:, :2].contiguous(), 100, 32)
    with pytest.raises(RuntimeError, match="group size"):
        ops.dequantize_int4(layer.qweight, scales, zeros, 100, 0)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        ops.dequantize_int4(layer.qweight.flatten(), scales, zeros, 100, 32)
