"""Non-uniform grids on the kernels: the native table-lookup W4A16 operators against the reference (4-bit grids, and
3-bit learned ones with their codes widened to nibbles), and the kernels that assume uniform codes refusing grid
layers."""

from __future__ import annotations

import shutil

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.kernels import candidates
from llmeasyquant.kernels.cpu import Int4WeightOnlyKernel, NativeInt4WeightOnlyKernel
from llmeasyquant.kernels.triton.layers import TritonW4A16Kernel
from llmeasyquant.nn.qlinear import forced_kernel

# Also run by tests/kernels/test_native_ops.py's W4A16 matmul test, beside the uniform schemes.
GRID_SCHEMES = ["w4a16-g64-nf4", "w4a16-g32-iq4nl", "w4a16-g64-learned", "w4a16-nf4", "w4a16-g30-learned",
                "w3a16-g64-learned", "w3a16-learned"]


def grid_layer(scheme: str, in_features: int, out_features: int) -> lq.QuantLinear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(7)) * 0.05
    return lq.QuantLinear.from_weight(weight, torch.randn(out_features), lq.parse_scheme(scheme))


def rows(count: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("scheme", GRID_SCHEMES)
def test_uniform_code_kernels_refuse_grid_layers(scheme):
    layer = grid_layer(scheme, 128, 16)
    assert not Int4WeightOnlyKernel().supports(layer)
    assert not TritonW4A16Kernel().supports(layer)
    names = [k.name for k in candidates(layer)]
    assert "cpu_int4pack_w4a16" not in names


def test_uniform_layers_still_take_the_int4_operator():
    layer = grid_layer("w4a16-g64", 128, 16)
    assert Int4WeightOnlyKernel().supports(layer)


@pytest.mark.parametrize("scheme", GRID_SCHEMES)
def test_reference_kernel_runs_grid_layers_on_their_dequantized_weight(scheme):
    layer = grid_layer(scheme, 128, 16)
    x = rows(3, 128)
    with forced_kernel(layer, "reference"), torch.no_grad():
        y = layer(x)
    assert torch.equal(y, x @ layer.dequantize().t() + layer.bias)


needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the fused operators cannot be built")


@needs_compiler
@pytest.mark.parametrize("scheme", GRID_SCHEMES)
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (100, 7), (101, 5)])
def test_dequantize_int4_levels_is_the_reference_weight_bit_for_bit(ops, scheme, in_features, out_features):
    layer = grid_layer(scheme, in_features, out_features)
    if layer.group_size % 2 and layer.group_size < in_features:
        return  # odd groups start mid-byte: not the operator's layout (the kernel is not offered, below)
    prepared = NativeInt4WeightOnlyKernel().prepare(layer)  # what the kernel hands the operator
    assert prepared["levels"].shape[-1] == 16
    found = ops.dequantize_int4_levels(prepared["qweight"], prepared["scales"], prepared["levels"], in_features,
                                       layer.group_size)
    assert torch.equal(found, layer.dequantize())


def test_three_bit_learned_layer_stores_three_bits_and_widens_only_for_the_kernel():
    layer = grid_layer("w3a16-g64-learned", 128, 8)
    assert layer.qweight.shape == (8, 48) and layer.levels.shape == (8, 8)  # 3 bits a weight, 8 levels a row
    codes = layer.codes()
    assert int(codes.min()) >= -4 and int(codes.max()) <= 3
    prepared = NativeInt4WeightOnlyKernel().prepare(layer)
    assert prepared["qweight"].shape == (8, 64)
    # The 8 levels sit where codes -4..3 plus 8 land; the padding repeats the ends.
    assert torch.equal(prepared["levels"][:, 4:12], layer.levels.float())
    assert torch.equal(prepared["levels"][:, :4], layer.levels.float()[:, :1].expand(8, 4))


@needs_compiler
def test_levels_operators_refuse_bad_tables(ops):
    layer = grid_layer("w4a16-g64-learned", 128, 8)
    scales = layer.scales.float()
    with pytest.raises(RuntimeError, match="levels must be"):
        ops.dequantize_int4_levels(layer.qweight, scales, torch.zeros(8, 15), 128, 64)
    with pytest.raises(RuntimeError, match="levels must be"):
        ops.int4_levels_matmul(rows(1, 128), layer.qweight, scales, torch.zeros(4, 16), 64)
    with pytest.raises(RuntimeError, match="levels must be Float"):
        ops.dequantize_int4_levels(layer.qweight, scales, torch.zeros(16, dtype=torch.float16), 128, 64)
