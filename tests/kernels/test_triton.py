"""The Triton kernels against the reference kernel (and the CPU integer kernel), run on CPU tensors by Triton's
interpreter; their refusals; and, without a GPU, that they compile for Hopper (sm_90) and use its tensor cores.

`@triton.jit` reads TRITON_INTERPRET when the kernel modules are imported, so a fixture sets it and reloads them
(and puts them back the way the environment wants after this module). Tests marked `gpu` run the compiled,
autotuned kernels on a real CUDA device instead.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from llmeasyquant.errors import ConfigError  # noqa: E402
from llmeasyquant.kernels import ALL_KERNELS, KERNELS_BY_DEVICE, native, select  # noqa: E402
from llmeasyquant.kernels.triton import launch as triton_launch  # noqa: E402
from llmeasyquant.kernels.triton import w4a16, w8a8  # noqa: E402
from llmeasyquant.nn.qlinear import QuantLinear  # noqa: E402
from llmeasyquant.primitives import quantize  # noqa: E402
from llmeasyquant.scheme import parse_scheme  # noqa: E402

W8A8, W4A16, CPU_W8A8, REFERENCE = "triton_w8a8", "triton_w4a16", "cpu_int_mm_w8a8", "reference"

# (in_features, out_features): partial groups (200 = 6.25 x 32), odd widths (33 columns: 17 bytes, a padding
# nibble), out_features not a multiple of the 16-wide tiles; all small, the interpreter runs each program in Python.
SHAPES = [(200, 33), (64, 48), (33, 17)]
SHAPE_IDS = [f"{i}x{o}" for i, o in SHAPES]
TOKENS = [1, 3, 17]

W8A8_SCHEMES = ["w8a8", "w8a8-asym", "w8a8-aasym", "w8a8-asym-aasym", "w8a8-apt", "w8a8-apt-aasym", "w8a8-pt"]
W4A16_SCHEMES = ["w4a16-g32", "w4a16-g64", "w4a16-g128", "w4a16", "w4a16-g32-asym", "w4a16-g64-asym",
                 "w4a16-g128-asym", "w4a16-asym", "w4a16-g48"]


def _interpreted() -> bool:
    return isinstance(w8a8._int8_gemm_kernel, InterpretedFunction)


def _reload_kernels(interpret: bool) -> None:
    if _interpreted() != interpret or isinstance(w4a16._w4a16_kernel, InterpretedFunction) != interpret:
        for module in (w8a8, w4a16):
            importlib.reload(module)


@pytest.fixture(scope="module", autouse=True)
def _restore_kernel_modules():
    yield
    _reload_kernels(triton_launch.interpreting())  # as the rest of the session's environment says


@pytest.fixture(autouse=True)
def _triton_mode(request, monkeypatch):
    """Interpreter for CPU tests, compiled kernels for `gpu` ones; no forced kernel from the environment."""
    monkeypatch.delenv("LLMEASYQUANT_KERNEL", raising=False)
    gpu = request.node.get_closest_marker("gpu") is not None
    monkeypatch.setenv("TRITON_INTERPRET", "0" if gpu else "1")
    _reload_kernels(not gpu)


def make_weight(in_features: int, out_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    weight[:, ::17] *= 4  # a few larger columns, so that groups differ in scale
    return weight


def make_input(tokens: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, in_features, generator=gen)
    x[:, ::13] *= 5  # activation outlier channels
    return x


def layer_trio(scheme_name: str, in_features: int, out_features: int,
               kernel: str) -> tuple[QuantLinear, QuantLinear, QuantLinear]:
    """(Triton kernel, reference, registry's choice on CPU) layers built from the same weight."""
    weight = make_weight(in_features, out_features, seed=in_features * 1000 + out_features)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(7)) * 0.1
    scheme = parse_scheme(scheme_name)
    layers = [QuantLinear.from_weight(weight, bias, scheme) for _ in range(3)]
    layers[0].kernel_name, layers[1].kernel_name = kernel, REFERENCE
    return layers[0], layers[1], layers[2]


def cpu_w8a8(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The CPU integer kernel's output without the bias, what the Triton launchers return."""
    kernel = ALL_KERNELS[CPU_W8A8]
    return kernel.run(layer, x, kernel.prepare(layer))


def rel_max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max())


def rel_rms_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


# W8A8: activation codes ----------------------------------------------------------------------------------------
def awkward_rows(in_features: int) -> torch.Tensor:
    """Rows that test rounding and the range: exact halves (absmax 127 gives scale 1.0, so x/scale is x), an
    all-zero row (the 2^-24 scale floor), tiny values, a one-sided row, and large values."""
    rows = make_input(6, in_features, seed=3)
    ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 4.5])
    rows[0] = ties.repeat(in_features // len(ties) + 1)[:in_features]
    rows[1] = 0.0
    rows[2] = rows[2] * 1e-9
    rows[3] = rows[3].abs() + 0.25  # no negative values: asymmetric zero point at the bottom of the range
    rows[4] = rows[4] * 3e4
    rows[5, :2] = torch.tensor([-127.5, 127.5])  # asymmetric scale 1.0: halves again
    rows[5, 2:] = torch.arange(in_features - 2) % 7 - 3.5
    return rows


@pytest.mark.parametrize("in_features", [200, 33, 2500])  # 2500: several steps of the 1024-wide row loop
@pytest.mark.parametrize("scheme_name", ["w8a8", "w8a8-aasym"])
def test_activation_codes_are_bit_identical(scheme_name, in_features):
    layer = QuantLinear.from_weight(make_weight(in_features, 16, seed=1), None, parse_scheme(scheme_name))
    x = torch.cat([make_input(5, in_features), awkward_rows(in_features)])
    qp = layer.activation_qparams(x)
    qx = w8a8.quantize_per_token(x, symmetric=layer.scheme.act.symmetric)
    codes = quantize(x, qp, 8)
    assert qx.q.dtype == torch.int8 and torch.equal(qx.q, codes)
    assert torch.equal(qx.scale, qp.scale[:, 0])  # fp32, bit for bit
    if qp.zero is None:
        assert qx.has_zero is False and not qx.zero.any()
    else:
        assert qx.has_zero and torch.equal(qx.zero, qp.zero[:, 0])
    assert torch.equal(qx.qsum, codes.sum(dim=1, dtype=torch.int32))
    # Half-precision inputs: the kernel widens them to fp32 exactly as x.float() does.
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.clamp(-6e4, 6e4).to(dtype)
        assert torch.equal(w8a8.quantize_per_token(xh, layer.scheme.act.symmetric).q,
                           quantize(xh.float(), layer.activation_qparams(xh.float()), 8))


def test_rounding_is_torch_round():
    """With scale 1 the codes are round(x) clamped: halves (to even), their float neighbours, tiny negatives
    (where v - floor(v) rounds), values past the int8 range."""
    halves = torch.arange(-130, 131, dtype=torch.float32) + 0.5
    neighbours = torch.cat([torch.nextafter(halves, halves + 1), torch.nextafter(halves, halves - 1)])
    tiny = -torch.tensor([2.0**-30, 2.0**-25, 0.25, 0.49999997, 0.5, 0.50000006, 1e-38, 0.0])
    x = torch.cat([halves, neighbours, tiny, -tiny, torch.tensor([1e9, -1e9, 2.0**23 + 1, -(2.0**23) - 1])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 16)).reshape(-1, 16)
    qx = w8a8.quantize_with_scale(x, torch.ones(1))
    assert torch.equal(qx.q, torch.round(x).clamp(-128, 127).to(torch.int8))


@pytest.mark.parametrize("scheme_name", ["w8a8-astatic", "w8a8-astatic-aasym"])
def test_static_scale_codes_are_bit_identical(scheme_name):
    layer = QuantLinear.from_weight(make_weight(200, 16, seed=1), None, parse_scheme(scheme_name))
    x = make_input(9, 200)
    layer.set_input_range(float(x.min()) * 0.5, float(x.max()) * 0.5)  # half the range: outliers clip
    qp = layer.activation_qparams(x)
    qx = w8a8.quantize_with_scale(x, qp.scale, qp.zero)
    assert torch.equal(qx.q, quantize(x, qp, 8))
    assert int(qx.q.max()) == 127 and int(qx.q.min()) == -128  # the clamp was exercised
    assert torch.equal(qx.scale, qp.scale.expand(9, 1)[:, 0])


def test_quantize_with_scale_checks_shapes():
    x = make_input(4, 32)
    with pytest.raises(ValueError, match="activation scales"):
        w8a8.quantize_with_scale(x, torch.ones(3))
    with pytest.raises(ValueError, match="zero points"):
        w8a8.quantize_with_scale(x, torch.ones(4), torch.zeros(1, dtype=torch.int32))
    # One scale per row works too (stride 1 rather than 0).
    scales = x.abs().amax(dim=1) / 127
    assert torch.equal(w8a8.quantize_with_scale(x, scales).q, w8a8.quantize_per_token(x).q)


# W8A8: outputs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("scheme_name", W8A8_SCHEMES)
def test_w8a8_matches_reference(scheme_name, in_features, out_features, tokens):
    layer, reference, cpu = layer_trio(scheme_name, in_features, out_features, W8A8)
    assert layer.kernel().name == W8A8 and cpu.kernel().name == CPU_W8A8
    x = make_input(tokens, in_features)
    y, ref = layer(x), reference(x)
    assert y.shape == ref.shape == (tokens, out_features) and y.dtype == torch.float32
    # The integer sums are exact; the reference rounds each of its K fp32 products and partial sums (K <= 200:
    # at most ~K * 2^-24 = 1.2e-5 relative), so 1e-4 of the largest output is a generous bound.
    assert rel_max_err(y, ref) <= 1e-4
    # Against the CPU integer kernel, which computes the same int32 sums and multiplies by the same scales in the
    # same order (acc * s_x * s_w), the outputs are bit-identical.
    assert torch.equal(y, cpu(x))


@pytest.mark.parametrize("scheme_name", ["w8a8-astatic", "w8a8-astatic-aasym"])
def test_w8a8_static_scale_matches_reference(scheme_name):
    layer, reference, cpu = layer_trio(scheme_name, 200, 33, W8A8)
    x = make_input(17, 200)
    for each in (layer, reference, cpu):
        each.set_input_range(float(x.min()) * 0.8, float(x.max()) * 0.8)
    y = layer(x)
    assert rel_max_err(y, reference(x)) <= 1e-4
    assert torch.equal(y, cpu(x))


@pytest.mark.parametrize(
    "config",
    [{"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 1}, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128,
                                                                   "GROUP_M": 4}],
    ids=["32x16x64", "16x32x128"],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_matmul_tiles_and_output_types(config, out_dtype):
    """Other tile shapes (more than one K step, tiles wider than the matrix) and 16-bit outputs."""
    layer, _, cpu = layer_trio("w8a8-asym-aasym", 200, 33, W8A8)
    x = make_input(40, 200)  # three 16-row tiles, so the grouped launch order wraps
    prepared = w8a8.prepare_weight(layer.qweight, layer.scales, layer.zeros)
    y = w8a8.int8_matmul(w8a8.quantize_per_token(x, symmetric=False), prepared, out_dtype=out_dtype, config=config)
    assert y.dtype == out_dtype and y.shape == (40, 33)
    expected = cpu_w8a8(cpu, x)
    if out_dtype == torch.bfloat16 and not torch.cuda.is_available():
        # The interpreter narrows fp32 to bf16 by truncation (GPUs round to nearest even): one bf16 step at most.
        torch.testing.assert_close(y.float(), expected, rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(y, expected.to(out_dtype), rtol=0, atol=0)


def test_w8a8_linear_and_empty_input():
    layer, _, cpu = layer_trio("w8a8", 64, 48, W8A8)
    prepared = w8a8.prepare_weight(layer.qweight, layer.scales, layer.zeros)
    x = make_input(3, 64)
    assert torch.equal(w8a8.w8a8_linear(x, prepared), cpu_w8a8(cpu, x))
    assert w8a8.w8a8_linear(x[:0], prepared).shape == (0, 48)


# W4A16 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("scheme_name", W4A16_SCHEMES)
def test_w4a16_matches_reference(scheme_name, in_features, out_features, tokens):
    layer, reference, _ = layer_trio(scheme_name, in_features, out_features, W4A16)
    assert layer.kernel().name == W4A16
    x = make_input(tokens, in_features)
    y, ref = layer(x), reference(x)
    assert y.shape == ref.shape == (tokens, out_features) and y.dtype == torch.float32
    # Activations are rounded to fp16 for the dot (relative error <= 2^-11 = 4.9e-4 each, random in sign), the
    # rest is exact or fp32: the output's relative RMS error sits near 2e-4; 1e-3 leaves room, while a wrong
    # nibble, group or zero point gives errors of order 1.
    assert rel_rms_err(y, ref) <= 1e-3


def _exact_path(prepared: w4a16.PreparedInt4Weight, block_k: int) -> bool:
    return prepared.one_group or prepared.group_size % block_k == 0


@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("scheme_name", ["w4a16-g32-asym", "w4a16-g64", "w4a16-g128-asym", "w4a16-asym", "w4a16-g48"])
def test_w4a16_scale_paths(scheme_name, block_k):
    """Every place the scales can be applied (per row after the loop, per tile, per weight), with inputs that
    fp16 holds exactly: where the weights enter the dot as integers the result is the reference's up to fp32
    summation order; where they are dequantized first, each rounds to fp16 (2^-11 relative)."""
    layer, reference, _ = layer_trio(scheme_name, 200, 33, W4A16)
    x = make_input(17, 200).half().float()
    prepared = w4a16.prepare_weight(layer.qweight, layer.scales, layer.zeros, layer.in_features, layer.group_size)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": block_k, "GROUP_M": 2}
    y = w4a16.w4a16_matmul(x, prepared, out_dtype=torch.float32, config=config) + layer.bias
    ref = reference(x)
    assert rel_max_err(y, ref) <= (1e-5 if _exact_path(prepared, block_k) else 2e-3)


def test_w4a16_half_inputs_and_outputs():
    layer, reference, _ = layer_trio("w4a16-g64-asym", 200, 33, W4A16)
    prepared = w4a16.prepare_weight(layer.qweight, layer.scales, layer.zeros, layer.in_features, layer.group_size)
    x = make_input(17, 200).half()
    y = w4a16.w4a16_matmul(x, prepared)  # output dtype follows the input's
    assert y.dtype == torch.float16
    assert rel_rms_err(y.float() + layer.bias, reference(x.float())) <= 1e-3
    assert w4a16.w4a16_matmul(x[:0], prepared).shape == (0, 33)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        w4a16.w4a16_matmul(x, prepared, dot_dtype=torch.float32)
    with pytest.raises(ValueError, match="columns"):
        w4a16.w4a16_matmul(x[:, :100], prepared)


def test_kernels_are_not_trivially_close():
    """Guard against a vacuous comparison: a layer with another weight is far from the reference."""
    for scheme_name, kernel in [("w8a8", W8A8), ("w4a16-g32-asym", W4A16)]:
        layer, reference, _ = layer_trio(scheme_name, 200, 33, kernel)
        wrong = QuantLinear.from_weight(make_weight(200, 33, seed=12345), layer.bias, parse_scheme(scheme_name))
        wrong.kernel_name = kernel
        x = make_input(17, 200)
        assert rel_rms_err(wrong(x), reference(x)) > 0.5
        assert rel_rms_err(layer(x), reference(x)) <= 1e-3


# registry and refusals ------------------------------------------------------------------------------------------
def test_registered_for_cuda_only():
    assert [k.name for k in KERNELS_BY_DEVICE["cuda"]] == [W8A8, W4A16]
    assert {W8A8, W4A16} <= set(ALL_KERNELS)
    assert not {W8A8, W4A16} & {k.name for k in KERNELS_BY_DEVICE["cpu"]}
    # CPU tensors keep the CPU kernels even while the interpreter is on.
    cpu_w4a16 = "cpu_native_w4a16" if native.ops() is not None else "cpu_int4pack_w4a16"
    for scheme_name, expected in [("w8a8", CPU_W8A8), ("w4a16-g64", cpu_w4a16)]:
        layer = QuantLinear.from_weight(make_weight(64, 16, seed=1), None, parse_scheme(scheme_name))
        assert select(layer).name == expected


@pytest.mark.parametrize(
    ("kernel", "scheme_name"),
    [
        (W8A8, "w8a16"),  # weight-only
        (W8A8, "w8a8-g64"),  # group-wise weight scales: not one scale per output column
        (W8A8, "w4a8-g128"),
        (W8A8, "w4a16-g64"),
        (W4A16, "w8a16"),
        (W4A16, "w4a8-g128"),  # quantized activations
        (W4A16, "w3a16-g32"),  # other bit widths pack differently
        (W4A16, "w2a16-g64-asym"),
        (W4A16, "w8a8"),
    ],
)
def test_supports_refuses_schemes(kernel, scheme_name):
    layer = QuantLinear.from_weight(make_weight(200, 16, seed=1), None, parse_scheme(scheme_name))
    assert not ALL_KERNELS[kernel].supports(layer)
    layer.kernel_name = kernel
    with pytest.raises(ConfigError, match="cannot run"):
        layer.kernel()


@pytest.mark.parametrize(("kernel", "scheme_name"), [(W8A8, "w8a8"), (W4A16, "w4a16-g64")])
def test_supports_refuses_cpu_tensors_without_the_interpreter(monkeypatch, kernel, scheme_name):
    layer = QuantLinear.from_weight(make_weight(64, 16, seed=1), None, parse_scheme(scheme_name))
    assert ALL_KERNELS[kernel].supports(layer)  # interpreter on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ALL_KERNELS[kernel].supports(layer)
    layer.kernel_name = kernel
    with pytest.raises(ConfigError, match="cannot run"):
        layer(make_input(1, 64))
    monkeypatch.setattr(triton_launch, "triton_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ALL_KERNELS[kernel].supports(layer)


def test_imports_without_triton():
    """triton is optional: with it unimportable the package and the registry load, and the kernels say no."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from llmeasyquant.kernels import ALL_KERNELS, KERNELS_BY_DEVICE\n"
        "from llmeasyquant import QuantLinear, parse_scheme\n"
        "import torch\n"
        "layer = QuantLinear.from_weight(torch.randn(16, 64), None, parse_scheme('w8a8'))\n"
        "assert [k.supports(layer) for k in KERNELS_BY_DEVICE['cuda']] == [False, False]\n"
        "assert 'triton_w8a8' in ALL_KERNELS\n"
        "print(layer(torch.randn(2, 64)).shape)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 16])" in result.stdout


# compiled for Hopper, without a GPU ------------------------------------------------------------------------------
def _compile_sm90(fn, signature: dict, constexprs: dict, aligned: tuple[int, ...], num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}  # what the launcher infers for aligned tensors
    src = ASTSource(fn=fn, signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs,
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def test_kernels_compile_for_sm90_with_tensor_cores(monkeypatch):
    """The interpreter checks the arithmetic, not code generation: compile the GPU kernels for an H100 (ptxas ships
    with triton; no GPU needed) and check that the GEMMs use wgmma and the quantization IEEE division."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _reload_kernels(False)
    quant = _compile_sm90(
        w8a8._quantize_rows_kernel,
        {"x_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "zero_ptr": "*i32", "qsum_ptr": "*i32",
         "in_scale_ptr": "*fp32", "in_zero_ptr": "*i32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32",
         "in_stride": "i32"},
        {"DYNAMIC": True, "HAS_ZERO": True, "BLOCK_K": 1024}, aligned=(0, 1), num_warps=4, num_stages=1)
    assert "div.rn.f32" in quant.asm["ptx"] and "div.full" not in quant.asm["ptx"]
    gemm = _compile_sm90(
        w8a8._int8_gemm_kernel,
        {"a_ptr": "*i8", "b_ptr": "*i8", "out_ptr": "*bf16", "a_scale_ptr": "*fp32", "a_zero_ptr": "*i32",
         "a_sum_ptr": "*i32", "b_scale_ptr": "*fp32", "b_zero_ptr": "*i32", "b_sum_ptr": "*i32", "M": "i32",
         "N": "i32", "K": "i32", "M_BUCKET": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_om": "i32"},
        {"A_ZERO": True, "B_ZERO": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8},
        aligned=(0, 1, 2, 11, 13, 14, 15), num_warps=8, num_stages=4)
    assert "wgmma" in gemm.asm["ptx"] and "cp.async" in gemm.asm["ptx"]
    for group, dot_dtype in [(128, tl.float16), (32, tl.bfloat16)]:
        kernel = _compile_sm90(
            w4a16._w4a16_kernel,
            {"x_ptr": "*fp16", "w_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*i8", "out_ptr": "*fp16",
             "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32", "stride_xm": "i32", "stride_wn": "i32",
             "stride_sn": "i32", "stride_om": "i32"},
            {"GROUP": group, "ONE_GROUP": False, "HAS_ZERO": True, "DOT_DTYPE": dot_dtype, "BLOCK_M": 128,
             "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8},
            aligned=(0, 1, 2, 3, 4, 6, 7, 9, 10, 12), num_warps=8, num_stages=3)
        assert "wgmma" in kernel.asm["ptx"]


# on a real GPU ---------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize(("scheme_name", "kernel"), [("w8a8", W8A8), ("w8a8-asym-aasym", W8A8),
                                                     ("w4a16-g128-asym", W4A16), ("w4a16-g32", W4A16),
                                                     ("w4a16", W4A16)])
def test_compiled_kernels_on_gpu(scheme_name, kernel, tokens):
    """The autotuned kernels on CUDA tensors, chosen by the registry; W8A8 bit-identical to the CPU kernel."""
    layer, reference, cpu = layer_trio(scheme_name, 1000, 300, kernel)
    layer.kernel_name = None
    layer.to("cuda")
    assert layer.kernel().name == kernel
    x = make_input(tokens, 1000)
    y = layer(x.cuda()).cpu()
    if kernel == W8A8:
        assert rel_max_err(y, reference(x)) <= 1e-4
        torch.testing.assert_close(y, cpu(x), rtol=0, atol=0)
    else:
        assert rel_rms_err(y, reference(x)) <= 1e-3


@pytest.mark.gpu
@needs_cuda
def test_w4a16_bf16_dot_on_gpu():
    """bf16 activations in the dot (the interpreter cannot run bf16 dots): 8 significant bits, so 2^-9 relative
    per activation; bound 5e-3."""
    layer, reference, _ = layer_trio("w4a16-g64-asym", 1000, 300, W4A16)
    prepared = w4a16.prepare_weight(layer.qweight.cuda(), layer.scales.cuda(), layer.zeros.cuda(), 1000, 64)
    x = make_input(33, 1000)
    y = w4a16.w4a16_matmul(x.cuda(), prepared, dot_dtype=torch.bfloat16).cpu() + layer.bias
    assert rel_rms_err(y, reference(x)) <= 5e-3
