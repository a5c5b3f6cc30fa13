"""W4A16 on bf16 dot products from the W4A8 tiles (native `int4_bf16_tiles_matmul`, kernel `cpu_bf16dot_w4a16`):
the reference's product of the activations rounded to bf16 and the exact weights, up to fp32's rounding of the
sums, on the vector path (AVX-512 BF16) and on the one-value-at-a-time path every other build runs."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_native_ops import int4_layer, rows

from llmeasyquant.kernels import ALL_KERNELS, candidates, native
from llmeasyquant.kernels.cpu import int4_tiles

pytestmark = pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")

KERNEL = ALL_KERNELS["cpu_bf16dot_w4a16"]
SCHEMES = ["w4a16", "w4a16-g32", "w4a16-g32-asym", "w4a16-g64-asym", "w4a16-g128", "w4a16-g8"]
# widths: whole pairs of blocks, a last lone block, a partial block (padding columns); channels: a partial tile
SHAPES = [(576, 40), (1536, 19), (104, 16), (100, 33), (8, 3)]


def product(layer, x: torch.Tensor) -> torch.Tensor:
    prepared = int4_tiles(layer, huge_pages=False)
    offsets = prepared["offsets"] if layer.zeros is not None else None
    return native.built().int4_bf16_tiles_matmul(x, prepared["tiled"], prepared["scales"], offsets, layer.group_size,
                                                  layer.out_features)


@pytest.mark.parametrize("count", [1, 5, 12, 13, 30])  # row blocks of 12: whole, one and a rest, several
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_reference_product_of_bf16_activations(scheme, in_features, out_features, count):
    layer = int4_layer(scheme, in_features, out_features)
    x = rows(count, in_features)
    found = product(layer, x)
    rounded = x.bfloat16().double()
    expected = rounded @ layer.dequantize().double().t()
    scale = rounded.abs() @ layer.dequantize().abs().double().t()
    assert ((found.double() - expected).abs() <= scale * 2e-6 + 1e-6).all()
    # the rounding of the activations is real: the fp32 activations' product differs
    assert not torch.allclose(found.double(), x.double() @ layer.dequantize().double().t(), rtol=1e-5, atol=0)


def test_zero_points_are_taken_off_with_the_rounded_activations():
    layer = int4_layer("w4a16-g32-asym", 576, 40)
    assert layer.zeros is not None and bool((layer.zeros != 0).any())
    x = rows(3, 576) + 5  # a large activation sum makes a forgotten zero-point term obvious
    expected = x.bfloat16().double() @ layer.dequantize().double().t()
    torch.testing.assert_close(product(layer, x).double(), expected, rtol=1e-5, atol=1e-4)


def test_offered_only_where_the_build_has_bf16_dot_products():
    layer = int4_layer("w4a16-g32", 576, 40)
    offered = KERNEL in candidates(layer)
    assert offered == native.built().bf16_dot_built()
    assert not KERNEL.supports(int4_layer("w4a16-g64-nf4", 576, 40))  # a grid's table is not u - 8
    assert not KERNEL.supports(int4_layer("w8a16", 576, 40))
