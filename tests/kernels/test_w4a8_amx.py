"""W4A8 on AMX's int8 tiles (native/w4a8_amx.cpp): the VNNI loop's result bit for bit, and an integer oracle."""

from __future__ import annotations

import pytest
import torch

from llmeasyquant.kernels import native
from llmeasyquant.kernels.cpu import tile_int4_codes

OPS = native.ops()
pytestmark = pytest.mark.skipif(OPS is None or not OPS.amx_int8_usable(),
                                reason="needs the fused operators on a CPU with AMX int8 tiles")


def operands(width: int, out: int, rows: int, group: int, zero_range: int, seed: int = 0):
    """qx, x_scales, tiles, scales, offsets as cpu.NativeInt4Int8Kernel prepares them, from random codes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (out, width), dtype=torch.int8, generator=gen)
    tiled = tile_int4_codes(codes)
    span = group if group < width else -(-width // 8) * 8
    groups = -(-(-(-width // 8) * 8) // span)
    padded = tiled.shape[0] * 16
    scales = torch.rand(groups, padded, generator=gen) + 0.5
    offsets = torch.full((groups, padded), 8, dtype=torch.int32)
    if zero_range:
        offsets += torch.randint(-zero_range, zero_range + 1, (groups, padded), dtype=torch.int32, generator=gen)
    qx, x_scales = OPS.quantize_rows(torch.randn(rows, width, generator=gen), 1e-8, 127)
    return codes, qx, x_scales, tiled, scales, offsets, span


def integer_oracle(codes, qx, x_scales, scales, offsets, span):
    """Exact int64 sums per group of qx (code + 8 - offset), then the fp32 steps in the kernels' order."""
    out, width = codes.shape
    total = torch.zeros(qx.shape[0], out)
    for g, first in enumerate(range(0, width, span)):
        part = slice(first, min(first + span, width))
        weights = codes[:, part].to(torch.int64) + 8 - offsets[g, :out, None].to(torch.int64)
        exact = qx[:, part].to(torch.int64) @ weights.t()
        total = torch.addcmul(total, exact.float(), scales[g, :out]) if scales.shape[0] > 1 else exact.float()
    if scales.shape[0] > 1:
        return total * x_scales
    return total * x_scales * scales[0, :out]


@pytest.mark.parametrize("zero_range", [0, 5])
@pytest.mark.parametrize("rows", [16, 33, 100])
@pytest.mark.parametrize(("width", "out", "group"), [
    (576, 192, 64), (1536, 576, 128), (576, 40, 32), (200, 24, 40), (100, 33, 10**9), (48, 8, 8), (256, 16, 24),
])
def test_amx_gives_the_vnni_loops_bits(width, out, rows, group, zero_range):
    codes, qx, x_scales, tiled, scales, offsets, span = operands(width, out, rows, group, zero_range)
    amx = OPS.int4_int8_matmul(qx, x_scales, tiled, scales, offsets, group, out, amx=2)
    vnni = OPS.int4_int8_matmul(qx, x_scales, tiled, scales, offsets, group, out, amx=0)
    assert torch.equal(amx, vnni)
    expected = integer_oracle(codes, qx, x_scales, scales, offsets, span)
    assert float((amx - expected).abs().max() / expected.abs().max()) <= 1e-6


def test_rows_past_a_pass_of_activations_and_offsets_at_the_edges():
    # 16384 columns: the activations go in passes of 64 rows (a megabyte each), so 100 rows take two; the offsets
    # -112 and 128 put the signed weight bytes at both ends of their range.
    codes, qx, x_scales, tiled, scales, offsets, span = operands(16384, 32, 100, 128, 0, seed=1)
    offsets[0, :16], offsets[1, 16:] = -112, 128
    amx = OPS.int4_int8_matmul(qx, x_scales, tiled, scales, offsets, 128, 32, amx=2)
    assert torch.equal(amx, OPS.int4_int8_matmul(qx, x_scales, tiled, scales, offsets, 128, 32, amx=0))
    expected = integer_oracle(codes, qx, x_scales, scales, offsets, span)
    assert float((amx - expected).abs().max() / expected.abs().max()) <= 1e-6


def test_offsets_past_a_signed_byte_stay_on_the_vnni_loop():
    codes, qx, x_scales, tiled, scales, offsets, span = operands(256, 48, 40, 64, 0, seed=2)
    offsets[1, 3] = 200  # a zero point far outside the 4-bit range: e = u - offset would not fit a signed byte
    y = OPS.int4_int8_matmul(qx, x_scales, tiled, scales, offsets, 64, 48, amx=2)
    expected = integer_oracle(codes, qx, x_scales, scales, offsets, span)
    assert float((y - expected).abs().max() / expected.abs().max()) <= 1e-6


def test_an_unknown_amx_setting_is_refused():
    _, qx, x_scales, tiled, scales, offsets, _ = operands(64, 16, 32, 32, 0)
    with pytest.raises(RuntimeError, match="amx must be 0"):
        OPS.int4_int8_matmul(qx, x_scales, tiled, scales, offsets, 32, 16, amx=3)
