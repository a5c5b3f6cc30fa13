"""Property tests of the rounding math: code ranges, round-trip error, exact zero, packing, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmeasyquant.errors import DataError
from llmeasyquant.primitives import (
    check_finite,
    choose_qparams,
    clip_activations,
    dequantize,
    fake_quantize,
    group_width,
    pack_int4,
    qrange,
    quantize,
    unpack_int4,
)
from llmeasyquant.scheme import PerChannel, PerGroup, PerTensor, PerToken

PROPERTY = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

BITS = st.sampled_from([2, 3, 4, 8])
# Widths and group sizes chosen so that many groups do not divide the width, and some exceed it.
WIDTHS = st.sampled_from([1, 2, 7, 33, 64, 100, 128, 576])
GRANULARITIES = st.sampled_from(
    [PerTensor(), PerChannel(), PerGroup(1), PerGroup(3), PerGroup(32), PerGroup(64), PerGroup(128), PerGroup(1000)]
)


@st.composite
def tensors(draw, max_rows: int = 4, magnitudes=(1e-3, 0.02, 1.0, 30.0)) -> torch.Tensor:
    """A float32 [rows, cols] tensor: random normal, scaled and shifted, with optional zeros and outliers."""
    rows, cols = draw(st.integers(1, max_rows)), draw(WIDTHS)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    magnitude = draw(st.sampled_from(magnitudes))
    shift = draw(st.sampled_from([0.0, 0.5, -2.0, 3.0]))
    x = (torch.randn(rows, cols, generator=gen) + shift) * magnitude
    if draw(st.booleans()):  # outliers
        mask = torch.rand(rows, cols, generator=gen) < 0.02
        x = torch.where(mask, x * 20, x)
    if draw(st.booleans()):  # exact zeros, and possibly a whole zero row
        x = torch.where(torch.rand(rows, cols, generator=gen) < 0.2, torch.zeros_like(x), x)
        if draw(st.booleans()):
            x[0] = 0
    return x


def expand_per_element(params: torch.Tensor, width: int, rows: int, cols: int) -> torch.Tensor:
    """[rows or 1, groups] -> [rows, cols] by indexing column c with group c // width (independent of the library)."""
    index = torch.arange(cols) // width
    return params[:, index].expand(rows, cols)


def element_params(x: torch.Tensor, qp) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    scale = expand_per_element(qp.scale, qp.group_size, rows, cols)
    zero = torch.zeros_like(scale) if qp.zero is None else expand_per_element(qp.zero.float(), qp.group_size,
                                                                                rows, cols)
    return scale, zero


def expected_groups(granularity, cols: int) -> tuple[int, int]:
    """(group width, groups per row) that the granularity implies for a row of `cols` values."""
    if isinstance(granularity, PerGroup):
        width = min(granularity.size, cols)
        return width, math.ceil(cols / width)
    return cols, 1


# qrange --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bits", "expected"), [(2, (-2, 1)), (3, (-4, 3)), (4, (-8, 7)), (8, (-128, 127))])
def test_qrange(bits, expected):
    assert qrange(bits) == expected


@pytest.mark.parametrize(("granularity", "cols", "width"),
                         [(PerGroup(128), 576, 128), (PerGroup(64), 100, 64), (PerGroup(1000), 100, 100),
                          (PerChannel(), 100, 100), (PerTensor(), 33, 33), (PerToken(), 7, 7)])
def test_group_width(granularity, cols, width):
    assert group_width(granularity, cols) == width


# qparams shape and codes ------------------------------------------------------------------------------------------
@PROPERTY
@given(x=tensors(), bits=BITS, symmetric=st.booleans(), granularity=GRANULARITIES)
def test_codes_lie_in_qrange_and_qparams_have_the_right_shape(x, bits, symmetric, granularity):
    rows, cols = x.shape
    qp = choose_qparams(x, bits, symmetric, granularity)
    width, groups = expected_groups(granularity, cols)
    assert qp.group_size == width
    assert qp.scale.shape == ((1, 1) if isinstance(granularity, PerTensor) else (rows, groups))
    assert qp.scale.dtype == torch.float32
    assert bool((qp.scale > 0).all())
    qmin, qmax = qrange(bits)
    if symmetric:
        assert qp.zero is None
    else:
        assert qp.zero is not None and qp.zero.shape == qp.scale.shape and qp.zero.dtype == torch.int32
        assert int(qp.zero.min()) >= qmin and int(qp.zero.max()) <= qmax
    codes = quantize(x, qp, bits)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert int(codes.min()) >= qmin and int(codes.max()) <= qmax
    # Values far outside the range the parameters were chosen for are clamped, never wrapped.
    wild = quantize(x * 1000 + 1, qp, bits)
    assert int(wild.min()) >= qmin and int(wild.max()) <= qmax


@PROPERTY
@given(x=tensors(magnitudes=(1e-6, 1e-3, 1.0, 30.0)), bits=BITS, granularity=GRANULARITIES)
def test_symmetric_scale_is_absmax_over_qmax_rounded_up_to_fp16(x, bits, granularity):
    """Each group's scale comes from that group's columns only (the last, partial group included), and is the
    smallest fp16 value >= absmax / qmax: rounding it down would clip the group's largest value."""
    cols = x.shape[1]
    qp = choose_qparams(x, bits, True, granularity)
    width, groups = expected_groups(granularity, cols)
    _, qmax = qrange(bits)
    if isinstance(granularity, PerTensor):
        absmax = x.abs().max().reshape(1, 1)
    else:
        absmax = torch.stack([x[:, g * width:(g + 1) * width].abs().amax(dim=1) for g in range(groups)], dim=1)
    exact = (absmax / qmax).clamp(min=2.0**-24)
    assert qp.scale.shape == exact.shape
    assert torch.equal(qp.scale, qp.scale.half().float())
    assert bool((qp.scale >= exact).all())
    below = torch.nextafter(qp.scale.half(), torch.tensor(float("-inf"), dtype=torch.float16)).float()
    assert bool((below < exact).all())


# round-trip error -------------------------------------------------------------------------------------------------
@PROPERTY
@given(x=tensors(), bits=BITS, symmetric=st.booleans(), granularity=GRANULARITIES)
def test_round_trip_error_within_half_a_step_inside_the_range(x, bits, symmetric, granularity):
    qp = choose_qparams(x, bits, symmetric, granularity)
    back = dequantize(quantize(x, qp, bits), qp)
    assert back.dtype == torch.float32 and back.shape == x.shape
    scale, zero = element_params(x, qp)
    qmin, qmax = qrange(bits)
    # The values the grid can represent to within half a step: [(qmin - zero) * s - s/2, (qmax - zero) * s + s/2].
    # (The asymmetric grid is shifted by up to half a step because the zero point is an integer.)
    inside = (x >= (qmin - zero - 0.5) * scale) & (x <= (qmax - zero + 0.5) * scale)
    assert inside.float().mean() > 0.5, "the chosen range misses most of the data"
    err = (back - x).abs()
    bound = scale * (0.5 + 1e-4)
    assert bool((err <= bound)[inside].all()), float(((err - bound) / scale)[inside].max())


@PROPERTY
@given(x=tensors(magnitudes=(1e-6, 1e-3, 0.05, 1.0, 30.0)), bits=BITS, symmetric=st.booleans(),
       granularity=GRANULARITIES, scale_dtype=st.sampled_from([torch.float16, None]))
def test_round_trip_error_within_half_a_step_everywhere(x, bits, symmetric, granularity, scale_dtype):
    """The range covers all the data: no value (a group's min and max included) is off by more than half a step,
    with fp16 scales (tiny, subnormal ones included) as with unrounded fp32 ones."""
    qp = choose_qparams(x, bits, symmetric, granularity, scale_dtype=scale_dtype)
    back = dequantize(quantize(x, qp, bits), qp)
    scale, _ = element_params(x, qp)
    err = (back - x).abs()
    assert bool((err <= scale * (0.5 + 1e-4)).all()), float((err / scale).max())


@pytest.mark.parametrize(
    ("values", "bits", "symmetric"),
    [
        ([-1.7, 0.4], 8, False),  # scale rounded to the nearest fp16 value clipped the max by 0.59 steps
        ([0.0, 127 * 2.0**-24 * 15.4], 8, True),  # nearest subnormal fp16 scale clipped the max by 3.4 steps
    ],
    ids=["asym-8bit", "sym-8bit-subnormal-scale"],
)
def test_fp16_scale_rounding_does_not_clip_the_range(values, bits, symmetric):
    x = torch.tensor([values])
    qp = choose_qparams(x, bits, symmetric, PerChannel())
    err = (dequantize(quantize(x, qp, bits), qp) - x).abs()
    assert bool((err <= qp.scale * (0.5 + 1e-4)).all()), float((err / qp.scale).max())


def test_scale_overflowing_fp16_is_an_error_not_nan():
    """A scale above the fp16 maximum (65504) would be stored as inf and dequantize to NaN."""
    x = torch.tensor([[1.0e7, -3.0e6, 0.5]])
    with pytest.raises(DataError, match="maximum"):
        choose_qparams(x, 8, True, PerChannel())
    # Unrounded scales (the activation path) have no such limit.
    qp = choose_qparams(x, 8, True, PerChannel(), scale_dtype=None)
    assert bool(torch.isfinite(dequantize(quantize(x, qp, 8), qp)).all())


@pytest.mark.parametrize(("cols", "group"), [(576, 128), (100, 64), (50, 64), (130, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_partial_last_group_uses_its_own_scale(cols, group, symmetric, bits):
    """Blow up only the last (partial) group: the full groups' scales and codes must not change."""
    gen = torch.Generator().manual_seed(cols * 7 + group)
    x = torch.randn(3, cols, generator=gen)
    y = x.clone()
    last = (cols // group) * group if cols % group else cols - group
    y[:, last:] *= 100
    qx = choose_qparams(x, bits, symmetric, PerGroup(group))
    qy = choose_qparams(y, bits, symmetric, PerGroup(group))
    groups = math.ceil(cols / min(group, cols))
    assert qx.scale.shape == (3, groups)
    torch.testing.assert_close(qx.scale[:, :-1], qy.scale[:, :-1], rtol=0, atol=0)
    assert bool((qy.scale[:, -1] > 20 * qx.scale[:, -1]).all())
    torch.testing.assert_close(quantize(x, qx, bits)[:, :last], quantize(y, qy, bits)[:, :last], rtol=0, atol=0)


# zero, determinism, fp16 scales ---------------------------------------------------------------------------------
@PROPERTY
@given(x=tensors(), bits=BITS, symmetric=st.booleans(), granularity=GRANULARITIES,
       seed=st.integers(0, 2**16))
def test_zero_is_exactly_representable(x, bits, symmetric, granularity, seed):
    gen = torch.Generator().manual_seed(seed)
    zero_mask = torch.rand(x.shape, generator=gen) < 0.3
    zero_mask[:, -1] = True
    x = torch.where(zero_mask, torch.zeros_like(x), x)
    qp = choose_qparams(x, bits, symmetric, granularity)
    back = dequantize(quantize(x, qp, bits), qp)
    assert bool((back[zero_mask] == 0).all())
    # And zero is representable whatever the data: the code `zero` (or 0 when symmetric) dequantizes to 0.
    codes = torch.zeros_like(x, dtype=torch.int8)
    if qp.zero is not None:
        codes = expand_per_element(qp.zero, qp.group_size, *x.shape).to(torch.int8)
    assert bool((dequantize(codes, qp) == 0).all())


@PROPERTY
@given(x=tensors(), bits=BITS, symmetric=st.booleans(), granularity=GRANULARITIES)
def test_deterministic_bit_for_bit(x, bits, symmetric, granularity):
    first = choose_qparams(x.clone(), bits, symmetric, granularity)
    second = choose_qparams(x.clone(), bits, symmetric, granularity)
    assert torch.equal(first.scale, second.scale)
    assert (first.zero is None) == (second.zero is None)
    if first.zero is not None:
        assert torch.equal(first.zero, second.zero)
    assert torch.equal(quantize(x.clone(), first, bits), quantize(x.clone(), second, bits))


@PROPERTY
@given(x=tensors(magnitudes=(1e-6, 1e-3, 1.0, 30.0, 200.0)), bits=BITS, symmetric=st.booleans(),
       granularity=GRANULARITIES)
def test_scales_are_fp16_representable(x, bits, symmetric, granularity):
    qp = choose_qparams(x, bits, symmetric, granularity)
    assert torch.equal(qp.scale, qp.scale.half().float())
    assert bool((qp.scale >= 2.0**-24).all())  # never rounds to zero when stored


def test_all_zero_tensor():
    x = torch.zeros(2, 10)
    for symmetric in (True, False):
        qp = choose_qparams(x, 4, symmetric, PerGroup(4))
        assert bool((qp.scale > 0).all())
        assert torch.equal(dequantize(quantize(x, qp, 4), qp), x)


def test_choose_qparams_needs_2d():
    with pytest.raises(ValueError, match="2-D"):
        choose_qparams(torch.zeros(2, 3, 4), 8, True, PerChannel())


# int4 packing ---------------------------------------------------------------------------------------------------
@PROPERTY
@given(rows=st.integers(1, 5), cols=st.integers(1, 41), seed=st.integers(0, 2**16))
def test_pack_unpack_int4_round_trip(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, math.ceil(cols / 2))
    unpacked = unpack_int4(packed, cols)
    assert unpacked.dtype == torch.int8 and unpacked.is_contiguous()
    assert torch.equal(unpacked, codes)


@pytest.mark.parametrize("cols", [1, 2, 5, 8])
def test_pack_int4_layout(cols):
    """Even column in the low nibble, odd column in the high one, both offset by 8; odd widths padded."""
    codes = torch.arange(cols, dtype=torch.int8).reshape(1, cols) - 8
    packed = pack_int4(codes)
    for c in range(cols):
        byte = int(packed[0, c // 2])
        nibble = byte & 0x0F if c % 2 == 0 else byte >> 4
        assert nibble == int(codes[0, c]) + 8
    assert torch.equal(unpack_int4(packed, cols), codes)


def test_pack_int4_extremes():
    codes = torch.tensor([[-8, 7, 7, -8, 0]], dtype=torch.int8)
    assert pack_int4(codes).tolist() == [[0xF0, 0x0F, 0x88]]
    assert torch.equal(unpack_int4(pack_int4(codes), 5), codes)


@pytest.mark.parametrize("bad", [8, -9, 127, -128])
def test_pack_int4_rejects_out_of_range_codes(bad):
    codes = torch.zeros(2, 6, dtype=torch.int8)
    codes[1, 3] = bad
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(codes)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_low_bit_codes_pack_losslessly(bits):
    x = torch.randn(4, 77, generator=torch.Generator().manual_seed(bits))
    qp = choose_qparams(x, bits, False, PerGroup(32))
    codes = quantize(x, qp, bits)
    assert torch.equal(unpack_int4(pack_int4(codes), 77), codes)


# fake_quantize --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 100), (2, 5, 64), (2, 1, 3, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_preserves_shape_and_dtype(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    y = fake_quantize(x, 8, True, PerToken())
    assert y.shape == x.shape and y.dtype == dtype
    # It actually rounds: few distinct values per row, and close to x.
    assert not torch.equal(y.float(), x.float()) or x.numel() < 3
    torch.testing.assert_close(y.float(), x.float(), rtol=0, atol=float(x.float().abs().max()) / 127 * 0.51 + 1e-2)


@PROPERTY
@given(x=tensors(), bits=BITS, symmetric=st.booleans(), granularity=GRANULARITIES)
def test_fake_quantize_matches_quantize_then_dequantize(x, bits, symmetric, granularity):
    qp = choose_qparams(x, bits, symmetric, granularity, scale_dtype=None)
    expected = dequantize(quantize(x, qp, bits), qp)
    assert torch.equal(fake_quantize(x, bits, symmetric, granularity), expected)


def test_fake_quantize_per_token_uses_one_scale_per_row():
    x = torch.tensor([[1.0, 0.5, 0.25], [100.0, 50.0, 25.0]])
    y = fake_quantize(x, 8, True, PerToken())
    # Row 0 keeps its precision although row 1 is 100x larger.
    torch.testing.assert_close(y[0], x[0], rtol=0, atol=1.0 / 127)
    assert y[1, 0] == 100.0


# check_finite ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_raises_data_error_naming_the_tensor(bad):
    t = torch.ones(3, 4)
    t[1, 2] = bad
    with pytest.raises(DataError, match=r"model\.layers\.3\.mlp\.up_proj\.weight") as info:
        check_finite(t, "model.layers.3.mlp.up_proj.weight")
    assert "1 NaN or infinite" in str(info.value)


def test_check_finite_counts_bad_values():
    t = torch.tensor([float("nan"), 1.0, float("inf"), float("nan")])
    with pytest.raises(DataError, match="3 NaN or infinite"):
        check_finite(t, "w")


def test_check_finite_accepts_finite_tensors():
    check_finite(torch.randn(5, 5).to(torch.bfloat16), "w")
    check_finite(torch.tensor([torch.finfo(torch.float32).max, 0.0]), "w")


# activation clipping --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", [PerToken(), PerTensor()])
def test_clipped_activations_scale_covers_the_clip_fraction_of_the_range(symmetric, granularity):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [3], [0.1], [10], [1]])
    clipped = clip_activations(x, 0.8, symmetric, granularity)
    full = choose_qparams(x, 4, symmetric, granularity, scale_dtype=None)
    short = choose_qparams(clipped, 4, symmetric, granularity, scale_dtype=None)
    torch.testing.assert_close(short.scale, full.scale * 0.8)
    assert bool((clipped.abs() <= x.abs()).all()) and bool((torch.sign(clipped) * torch.sign(x) >= 0).all())
    dims = (0, 1) if isinstance(granularity, PerTensor) else (1,)
    reach = torch.minimum(-x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True))
    inside = x.abs() < 0.5 * reach  # well inside the clipped range (either side): untouched
    assert torch.equal(clipped[inside], x[inside])


def test_clip_one_returns_the_input_itself():
    x = torch.randn(3, 8)
    assert clip_activations(x, 1.0, True, PerToken()) is x


def test_clipping_lowers_four_bit_error_on_gaussian_tokens():
    """Why the option exists: 4-bit per-token codes of near-Gaussian rows (what a rotation makes of the stream)
    lose less to the clipped tails than they gain from finer steps."""
    x = torch.randn(256, 576, generator=torch.Generator().manual_seed(1))
    errors = {clip: float((fake_quantize(clip_activations(x, clip, True, PerToken()), 4, True, PerToken()) - x)
                          .pow(2).mean()) for clip in (1.0, 0.9, 0.8)}
    assert errors[0.8] < errors[0.9] < errors[1.0], errors
