"""W4A16 decode on integer dot products (native `int4_digits_matmul`, kernel `cpu_native_w4a16_i16`): activations
as 16-bit fixed point per 32 columns, against a Python model of that rounding and against the fp32 reference."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_grid_kernels import GRID_SCHEMES
from tests.kernels.test_native_ops import forced_and_reference, int4_layer, rows

from llmeasyquant.kernels import candidates

KERNEL = "cpu_native_w4a16_i16"
CHUNK, LARGEST = 32, 32639.0  # columns that share a scale; the largest code, 127 * 256 + 127


def fixed_point(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as the kernel carries it, in float64; each column's step s): per 32 columns s = max|x| / 32639 and
    q = round(x / s), half to even, in fp32 as the kernel divides and rounds."""
    count, width = x.shape
    padded = torch.nn.functional.pad(x, (0, -width % CHUNK)).reshape(count, -1, CHUNK)
    step = padded.abs().amax(dim=2, keepdim=True) / LARGEST
    codes = torch.where(step > 0, padded / step.clamp(min=torch.finfo(torch.float32).tiny), 0).round()
    carried = (codes.double() * step.double()).reshape(count, -1)[:, :width]
    return carried, step.expand_as(padded).reshape(count, -1)[:, :width]


def run(ops, layer, x: torch.Tensor) -> torch.Tensor:
    zeros = layer.zeros.float() if layer.zeros is not None else None
    return ops.int4_digits_matmul(x, layer.qweight, layer.scales.float(), zeros, layer.group_size)


SCHEMES = ["w4a16", "w4a16-pt", "w4a16-g32-asym", "w4a16-g64", "w4a16-g128-asym", "w4a16-g96-asym", "w4a16-g8"]
SHAPES = [(576, 19), (2048, 40), (100, 7), (101, 5), (8192, 6), (40, 3), (256, 203), (128, 1100)]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("count", [1, 3, 6])
def test_the_sums_are_those_of_the_fixed_point_activations(ops, scheme, in_features, out_features, count):
    """Exact integer sums per 8 columns, scaled in fp32: the float64 product of the carried activations and the
    fp32 weight, to within fp32's rounding of the scaled partial sums. Sizes cover a last block of 128 columns cut
    short, an odd width (a padding nibble), a row shorter than one chunk, groups of 8 (16 in a block) to a row, and
    channel counts that are not multiples of the streams of 4 (203 on two threads), and a last eighth of the
    channels in several chunks that the threads take as they come (1100)."""
    layer = int4_layer(scheme, in_features, out_features)
    weight = layer.dequantize().double()
    x = rows(count, in_features) * torch.linspace(0.01, 4, in_features)  # chunks of unequal ranges
    carried, _ = fixed_point(x)
    expected = carried @ weight.t()
    assert ((run(ops, layer, x).double() - expected).abs() <= (carried.abs() @ weight.abs().t()) * 2e-6 + 1e-9).all()


@pytest.mark.parametrize("scheme", ["w4a16-g64", "w4a16-g128-asym", "w4a16-pt"])
def test_the_result_is_within_half_a_step_of_each_activation_of_the_reference(ops, scheme):
    """Against the fp32 reference: each activation moves by at most half its chunk's step (max|x| / 65278), so the
    sum by at most sum_i |w_i| s_i / 2, plus rounding; and it does move (not the reference's bits)."""
    layer = int4_layer(scheme, 4096, 24)
    weight = layer.dequantize().double()
    x = rows(2, 4096) * torch.linspace(0.01, 4, 4096)
    x[:, 7] = 300.0  # an outlier: its chunk's step grows, the others' do not
    _, step = fixed_point(x)
    found, expected = run(ops, layer, x).double(), x.double() @ weight.t()
    bound = (step.double() / 2) @ weight.abs().t() + (x.double().abs() @ weight.abs().t()) * 2e-6
    assert ((found - expected).abs() <= bound).all()
    assert not torch.equal(found.float(), (x @ layer.dequantize().t()))


def test_integer_activations_of_full_range_are_carried_exactly(ops):
    """Each chunk's largest value 32639 makes the step 1, so integer activations are the codes themselves, both
    digits at their extremes included: the result is the exact product up to fp32 rounding."""
    layer = int4_layer("w4a16-g32-asym", 256, 9)
    x = torch.randint(-32639, 32640, (3, 256), generator=torch.Generator().manual_seed(1)).float()
    x[:, ::32] = 32639.0
    x[0, 1::32] = -32639.0
    weight = layer.dequantize().double()
    expected = x.double() @ weight.t()
    assert ((run(ops, layer, x).double() - expected).abs() <= (x.double().abs() @ weight.abs().t()) * 2e-6).all()


def test_non_finite_activations_give_non_finite_rows_and_zero_rows_give_zero(ops):
    layer = int4_layer("w4a16-g64-asym", 300, 10)
    x = rows(3, 300)
    x[0, 5], x[1, 299] = float("nan"), float("inf")
    x[2] = 0.0
    found = run(ops, layer, x)
    assert found[:2].isnan().all()
    assert torch.equal(found[2], torch.zeros(10))


@pytest.mark.parametrize("count", [1, 16, 17, 40])
def test_the_kernel_runs_layers_and_is_its_parent_above_sixteen_rows(ops, count):
    layer = int4_layer("w4a16-g128-asym", 576, 33)
    assert KERNEL in [k.name for k in candidates(layer)]
    assert [k.name for k in candidates(layer)][:1] == ["cpu_native_w4a16"]  # `first` mode keeps 16 bits a value
    x = rows(count, 576)
    found, expected = forced_and_reference(layer, KERNEL, x)
    if count > 16:
        assert torch.equal(found, expected)
    else:
        bias = layer.bias.double() if layer.bias is not None else 0
        assert torch.allclose(found.double() - bias, fixed_point(x)[0] @ layer.dequantize().double().t(),
                              rtol=0, atol=1e-4)


@pytest.mark.parametrize("scheme", ["w4a16-g30", "w4a16-g36", "w3a16-g64", "w8a16", "w4a8-g128", *GRID_SCHEMES])
def test_the_kernel_is_offered_only_for_uniform_4_bit_codes_in_groups_of_eights(ops, scheme):
    assert KERNEL not in [k.name for k in candidates(int4_layer(scheme, 576, 8))]


def test_groups_that_split_eight_columns_are_refused(ops):
    layer = int4_layer("w4a16-g30", 100, 7)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.int4_digits_matmul(rows(1, 100), layer.qweight, layer.scales.float(), None, 30)


# 33024 columns: 258 groups of 128, more than the kernel widens into a local row (kDigitLocalGroups): the general path
@pytest.mark.parametrize(("in_features", "smaller"), [(4096, 64), (576, 8), (300, 32), (33024, 64)])
def test_a_scale_a_block_and_a_scale_a_lane_give_the_same_bits(ops, in_features, smaller):
    """Groups of 128 take one broadcast scale a block (from a local fp32 row of the channel's scales, up to 256
    groups); smaller groups pick each lane's. The same scales written as smaller groups (each repeated) must give the
    same sums to the bit, on whole streams of channels and the tail, fp32 and fp16 scales alike."""
    layer = int4_layer("w4a16-g128", in_features, 21)
    x = rows(2, in_features)
    scales = layer.scales.float()
    repeated = scales.repeat_interleave(128 // smaller, dim=1)[:, : -(-in_features // smaller)].contiguous()
    per_block = ops.int4_digits_matmul(x, layer.qweight, scales, None, 128)
    per_lane = ops.int4_digits_matmul(x, layer.qweight, repeated, None, smaller)
    assert torch.equal(per_block, per_lane)
    half = ops.int4_digits_matmul(x, layer.qweight, layer.scales.half(), None, 128)
    assert torch.equal(half, ops.int4_digits_matmul(x, layer.qweight, layer.scales.half().float(), None, 128))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("count", [1, 3])
def test_fp16_scales_are_read_as_stored_with_the_bits_of_their_fp32_widening(ops, scheme, count):
    layer = int4_layer(scheme, 576, 203)
    half_zeros = layer.zeros.half() if layer.zeros is not None else None
    wide_zeros = half_zeros.float() if half_zeros is not None else None
    x = rows(count, 576)
    as_stored = ops.int4_digits_matmul(x, layer.qweight, layer.scales.half(), half_zeros, layer.group_size)
    widened = ops.int4_digits_matmul(x, layer.qweight, layer.scales.half().float(), wide_zeros, layer.group_size)
    assert torch.equal(as_stored, widened)


def test_the_kernel_keeps_fp16_scales_without_an_fp32_copy(ops):
    layer = int4_layer("w4a16-g128-asym", 576, 33)
    assert layer.scales.dtype == torch.float16 and layer.zeros.dtype == torch.int8
    prepared = next(k for k in candidates(layer) if k.name == KERNEL).prepare(layer)
    assert prepared["scales"].data_ptr() == layer.scales.data_ptr()
    assert prepared["zeros"].dtype == torch.float16 and torch.equal(prepared["zeros"].float(), layer.zeros.float())


def test_scales_of_another_dtype_or_zeros_of_another_dtype_are_refused(ops):
    layer = int4_layer("w4a16-g128-asym", 256, 5)
    x = rows(1, 256)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        ops.int4_digits_matmul(x, layer.qweight, layer.scales.bfloat16(), None, 128)
    with pytest.raises(RuntimeError, match="zeros"):
        ops.int4_digits_matmul(x, layer.qweight, layer.scales.half(), layer.zeros.float(), 128)


@pytest.mark.parametrize(("group_size", "message"),
                         [(0, "group size must be even"), (64, r"scales must be \[out, groups\]")])
def test_a_group_size_that_does_not_fit_the_scales_is_refused(ops, group_size, message):
    layer = int4_layer("w4a16-g128", 256, 5)
    with pytest.raises(RuntimeError, match=message):
        ops.int4_digits_matmul(rows(1, 256), layer.qweight, layer.scales.half(), None, group_size)
