"""W8A8 on the fp32 GEMM (native `int8_float_matmul`, kernel `cpu_fp32_w8a8`): the integer kernels' codes and
scaling, the sums taken in fp32."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_native_ops import forced_and_reference, rows

import llmeasyquant as lq
from llmeasyquant.kernels import candidates
from llmeasyquant.primitives import MIN_SCALE

KERNEL = "cpu_fp32_w8a8"


def codes(count: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(-127, 128, (count, width), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("count", "width", "out"), [(1, 576, 960), (7, 100, 3), (128, 1024, 3000), (16, 40, 1)])
def test_sums_below_two_to_the_24_give_the_integer_kernels_bits(ops, count, width, out):
    """Every partial sum of int8 products is exact in fp32 while it stays below 2^24 (1024 columns of codes within
    +-127 do); the scaling is dequantize_rows', so the result is int8_int8_matmul's bit for bit. 3000 channels of
    1024 columns span three chunks of widened codes."""
    qx, q = codes(count, width, 0), codes(out, width, 1)
    x_scales, w_scales = torch.rand(count, 1) + 0.01, torch.rand(out) + 0.01
    w_sums = q.sum(dim=1, dtype=torch.int32)
    found = ops.int8_float_matmul(qx, x_scales, q, w_scales)
    assert torch.equal(found, ops.int8_int8_matmul(qx, x_scales, q, w_scales, w_sums))


def test_wider_rows_round_only_the_sums(ops):
    """Past 2^24 the fp32 sums round: within a relative 2^-24 per addition of the exact int32 product."""
    qx, q = codes(4, 8192, 2), codes(64, 8192, 3)
    exact = (qx.double() @ q.double().t())
    found = ops.int8_float_matmul(qx, torch.ones(4, 1), q, torch.ones(64))
    assert ((found.double() - exact).abs() <= (qx.double().abs() @ q.double().abs().t()) * 8192 * 2.0 ** -24).all()


def test_bad_shapes_are_refused(ops):
    with pytest.raises(RuntimeError, match="must share in"):
        ops.int8_float_matmul(codes(2, 8, 0), torch.ones(2, 1), codes(3, 9, 1), torch.ones(3))
    with pytest.raises(RuntimeError, match="one value per output channel"):
        ops.int8_float_matmul(codes(2, 8, 0), torch.ones(2, 1), codes(3, 8, 1), torch.ones(4))


@pytest.mark.parametrize("count", [1, 16, 130])
def test_the_kernel_runs_w8a8_layers_as_the_integer_kernel_does(ops, count):
    weight = torch.randn(96, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    layer = lq.QuantLinear.from_weight(weight, torch.randn(96), lq.parse_scheme("w8a8"))
    assert KERNEL in [k.name for k in candidates(layer)]
    assert next(k.name for k in candidates(layer)) == "cpu_int_mm_w8a8"  # `first` mode keeps exact int32 sums
    x = rows(count, 576)
    found, _ = forced_and_reference(layer, KERNEL, x)
    integer, _ = forced_and_reference(layer, "cpu_native_w8a8", x)
    assert torch.equal(found, integer)  # 576 columns: sums below 2^24
    qx, scale = ops.quantize_rows(x, MIN_SCALE, 127)
    assert torch.equal(found, ops.int8_float_matmul(qx, scale, layer.qweight, layer.scales[:, 0].float())
                       + layer.bias.float())


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8-asym", "w4a8-g128"])
def test_the_kernel_is_offered_only_for_symmetric_w8a8(ops, scheme):
    weight = torch.randn(8, 576, generator=torch.Generator().manual_seed(5))
    layer = lq.QuantLinear.from_weight(weight, None, lq.parse_scheme(scheme))
    assert KERNEL not in [k.name for k in candidates(layer)]
