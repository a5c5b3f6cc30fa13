"""W4A16 decode from weight tiles (native `int4_tiles_pack` / `int4_tiles_matmul`, read by the digits kernel
`cpu_native_w4a16_i16` where they hold its groups): the digits kernel's sums, bit for bit, from codes and scales
repacked into tiles of 8 channels x 128 columns."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_native_ops import forced_and_reference, int4_layer, rows

from llmeasyquant.kernels import candidates

KERNEL = "cpu_native_w4a16_i16"
SCHEMES = ["w4a16", "w4a16-pt", "w4a16-g32", "w4a16-g32-asym", "w4a16-g64-asym", "w4a16-g128", "w4a16-g256-asym"]
# widths: a last block cut short, an odd width (a padding nibble), one chunk; channels: not a multiple of 8, one
# tile, a last eighth in several chunks the threads take as they come (1100)
SHAPES = [(576, 19), (2048, 40), (100, 7), (101, 5), (8192, 6), (40, 3), (256, 203), (128, 1100)]


# The AVX-512 build sums the tiles in the digits kernel's order; the AVX2 build's tiles path sums 8 lanes at a time
# where the digits kernel there sums value by value: the same exact integers, fp32 sums in another order.
SAME_ORDER = torch.backends.cpu.get_cpu_capability() == "AVX512"


def assert_digits_sums(found: torch.Tensor, digits: torch.Tensor, x: torch.Tensor, layer) -> None:
    if SAME_ORDER:
        assert torch.equal(found, digits)
    else:
        scale = x.abs().double() @ layer.dequantize().abs().double().t()
        assert ((found.double() - digits.double()).abs() <= scale * 1e-5 + 1e-6).all()


def digits_and_tiles(ops, layer, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scales = layer.scales.to(dtype)
    zeros = layer.zeros.to(dtype) if layer.zeros is not None else None
    digits = ops.int4_digits_matmul(x, layer.qweight, scales, zeros, layer.group_size)
    tiles = ops.int4_tiles_pack(layer.qweight, scales, layer.in_features, layer.group_size)
    return digits, ops.int4_tiles_matmul(x, tiles, scales, zeros, layer.group_size)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("count", [1, 3, 16])
def test_the_sums_are_the_digits_kernels_bit_for_bit(ops, scheme, in_features, out_features, count):
    layer = int4_layer(scheme, in_features, out_features)
    x = rows(count, in_features) * torch.linspace(0.01, 4, in_features)  # chunks of unequal ranges
    for dtype in (torch.float16, torch.float32):
        digits, tiles = digits_and_tiles(ops, layer, x, dtype)
        assert_digits_sums(tiles, digits, x, layer)


def test_non_finite_activations_give_non_finite_rows_and_zero_rows_give_zero(ops):
    layer = int4_layer("w4a16-g64-asym", 300, 10)
    x = rows(3, 300)
    x[0, 5], x[1, 299] = float("nan"), float("inf")
    x[2] = 0.0
    _, found = digits_and_tiles(ops, layer, x, torch.float16)
    assert found[:2].isnan().all()
    assert torch.equal(found[2], torch.zeros(10))


def test_a_tile_holds_eight_channels_codes_then_their_scales():
    """The layout the kernel reads: tile (t, b) is channel 8t + c's bytes 64b..64b+63 at 64c, then the 8 channels'
    scales for the block's 4 chunks of 32 columns (g32, fp16), channel-major; channels past the last are zero."""
    from llmeasyquant.kernels import native

    ops = native.built()
    layer = int4_layer("w4a16-g32", 256, 11)
    scales = layer.scales.half()
    tiles = ops.int4_tiles_pack(layer.qweight, scales, 256, 32)
    assert tiles.shape == (2, 2, 512 + 8 * 4 * 2)
    tile = tiles[1, 1]
    assert torch.equal(tile[64 * 2:64 * 3], layer.qweight[10, 64:128])
    assert torch.equal(tile[64 * 3:512], torch.zeros(512 - 64 * 3, dtype=torch.uint8))
    tile_scales = tile[512:].view(torch.float16).reshape(8, 4)
    assert torch.equal(tile_scales[2], scales[10, 4:8])
    assert torch.equal(tile_scales[3:], torch.zeros(5, 4, dtype=torch.float16))


@pytest.mark.parametrize("count", [1, 16, 17])
@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a16-g16"])
def test_the_digits_kernel_reads_tiles_where_they_hold_its_groups(ops, scheme, count):
    """The digits kernel's sums whichever layout it reads: tiles for g32, the stored codes for g16."""
    layer = int4_layer(scheme, 576, 33)
    kernel = next(k for k in candidates(layer) if k.name == KERNEL)
    prepared = kernel.prepare(layer)
    assert (prepared["tiles"] is not None) == (scheme == "w4a16-g32-asym")
    x = rows(count, 576)
    found, expected = forced_and_reference(layer, KERNEL, x)
    scales = layer.scales.half()
    zeros = layer.zeros.half() if layer.zeros is not None else None
    if count <= 16:
        digits = ops.int4_digits_matmul(x, layer.qweight, scales, zeros, layer.group_size) + layer.bias.float()
        assert_digits_sums(found, digits, x, layer)
    else:
        assert torch.equal(found, expected)
    call = kernel.step_call(layer, prepared, count)
    assert call.kind == ("int4_dequant" if count > 16 else "int4_tiles" if prepared["tiles"] is not None
                         else "int4_digits")


def test_tiles_for_other_groups_or_other_weights_are_refused(ops):
    layer = int4_layer("w4a16-g96", 384, 5)
    with pytest.raises(RuntimeError, match="groups of 32 or 64"):
        ops.int4_tiles_pack(layer.qweight, layer.scales.half(), 384, 96)
    layer = int4_layer("w4a16-g128", 384, 5)
    tiles = ops.int4_tiles_pack(layer.qweight, layer.scales.half(), 384, 128)
    g64_scales = layer.scales.half().repeat_interleave(2, dim=1)
    with pytest.raises(RuntimeError, match="tiles must be"):
        ops.int4_tiles_matmul(rows(1, 384), tiles, g64_scales, None, 64)
    with pytest.raises(RuntimeError, match="tiles must be"):  # fp32 scales: tiles of another size
        ops.int4_tiles_matmul(rows(1, 384), tiles, layer.scales.float(), None, 128)
