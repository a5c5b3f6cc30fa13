"""Every CPU kernel against the reference kernel, the registry's choice, forced kernels, and QuantLinear itself."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from llmeasyquant.errors import ConfigError, DataError
from llmeasyquant.kernels import ALL_KERNELS, native, select
from llmeasyquant.nn.qlinear import QuantLinear, layer_storage_bytes
from llmeasyquant.primitives import qrange
from llmeasyquant.scheme import PerGroup, parse_scheme

# (in_features, out_features): awkward widths on purpose (partial groups, out not a multiple of 16, in % 16 != 0).
SHAPES = [(576, 192), (1536, 576), (64, 48), (100, 33), (48, 8)]
TOKENS = [1, 7, 64]

W8A8_SCHEMES = ["w8a8", "w8a8-asym", "w8a8-aasym", "w8a8-asym-aasym", "w8a8-apt-aasym"]
WEIGHT_ONLY_SCHEMES = ["w8a16", "w8a16-asym", "w4a16-g32", "w4a16-g64", "w4a16-g128", "w4a16-g128-asym", "w4a16",
                       "w3a16-g32", "w2a16-g64-asym"]

INT_MM, INT8PACK, INT4PACK, REFERENCE = "cpu_int_mm_w8a8", "cpu_int8pack_w8a16", "cpu_int4pack_w4a16", "reference"
# W8A16 runs the fused operators' int8-weight matmul where they build (any width), else PyTorch's int8 operator
# (widths that are multiples of 16), else the reference.
NATIVE_W8 = "cpu_native_w8a16" if native.ops() is not None else None
W8_WIDE = NATIVE_W8 or INT8PACK  # the choice for widths that are multiples of 16
W8_ODD = NATIVE_W8 or REFERENCE  # for other widths
# W4A16 likewise: the fused operators' kernel (any even group, or one group a row), else PyTorch's int4 operator
# (groups 32-256, or per channel), else the reference. 2- and 3-bit codes go to the int4 operator.
NATIVE_W4 = "cpu_native_w4a16" if native.ops() is not None else None
W4 = NATIVE_W4 or INT4PACK
W4_OTHER_GROUP = NATIVE_W4 or REFERENCE
# W4A8 (dynamic per-token activations, groups a multiple of 8 wide) runs the native integer matmul.
W4A8 = "cpu_native_w4a8" if native.ops() is not None else REFERENCE
W4A8_SCHEMES = ["w4a8", "w4a8-asym", "w4a8-g32", "w4a8-g64", "w4a8-g64-asym", "w4a8-g128-asym", "w4a8-g8",
                "w4a4-g64", "w4a4-asym", "w4a8-aasym", "w4a4-aasym-g64-asym", "w4a4-aasym-ac90-g32",
                # activation scales per token per weight group
                "w4a4-ag64-g64", "w4a4-aasym-ag32-g32-asym", "w4a8-aasym-acs-ag64-g64"]


@pytest.fixture(autouse=True)
def _no_forced_kernel(monkeypatch):
    monkeypatch.delenv("LLMEASYQUANT_KERNEL", raising=False)


def make_weight(in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    # A few larger columns, as in real LLM weights, so that groups differ in scale.
    weight[:, ::17] *= 4
    bias = torch.randn(out_features, generator=gen) * 0.1
    return weight, bias


@functools.cache
def layer_pair(scheme_name: str, in_features: int, out_features: int) -> tuple[QuantLinear, QuantLinear]:
    """(registry's choice, reference) built from the same weight; cached because building them dominates runtime."""
    weight, bias = make_weight(in_features, out_features, seed=in_features * 1000 + out_features)
    scheme = parse_scheme(scheme_name)
    layer = QuantLinear.from_weight(weight, bias, scheme)
    reference = QuantLinear.from_weight(weight, bias, scheme)
    reference.kernel_name = REFERENCE
    return layer, reference


def make_input(tokens: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, in_features, generator=gen)
    x[:, ::13] *= 5  # activation outlier channels
    return x


def expected_kernel(scheme_name: str, in_features: int) -> str:
    """What the registry should pick on CPU for the schemes in this file (written out, not derived from src)."""
    if scheme_name in W8A8_SCHEMES:
        return INT_MM
    if scheme_name in ("w8a16", "w8a16-asym"):
        return W8_WIDE if in_features % 16 == 0 else W8_ODD
    return W4 if scheme_name.startswith("w4") else INT4PACK


def rel_rms_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


# kernels against the reference --------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
@pytest.mark.parametrize("scheme_name", W8A8_SCHEMES)
def test_w8a8_kernel_matches_reference(scheme_name, in_features, out_features, tokens):
    layer, reference = layer_pair(scheme_name, in_features, out_features)
    assert layer.kernel().name == INT_MM
    assert reference.kernel().name == REFERENCE
    x = make_input(tokens, in_features)
    y, ref = layer(x), reference(x)
    assert y.shape == ref.shape == (tokens, out_features) and y.dtype == torch.float32
    # Both sum the integer products exactly and scale them in the same order: the same bits, not just close.
    assert torch.equal(y, ref)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
@pytest.mark.parametrize("scheme_name", WEIGHT_ONLY_SCHEMES)
def test_weight_only_kernel_matches_reference(scheme_name, in_features, out_features, tokens):
    layer, reference = layer_pair(scheme_name, in_features, out_features)
    assert layer.kernel().name == expected_kernel(scheme_name, in_features)
    assert reference.kernel().name == REFERENCE
    x = make_input(tokens, in_features)
    y, ref = layer(x), reference(x)
    assert y.shape == ref.shape == (tokens, out_features) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert rel_rms_err(y, ref) <= 1e-2


@pytest.mark.parametrize("tokens", [1, 5, 9, 64])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
@pytest.mark.parametrize("scheme_name", W4A8_SCHEMES)
def test_w4a8_kernel_matches_reference(scheme_name, in_features, out_features, tokens):
    layer, reference = layer_pair(scheme_name, in_features, out_features)
    assert layer.kernel().name == W4A8
    x = make_input(tokens, in_features)
    y, ref = layer(x), reference(x)
    assert y.shape == ref.shape == (tokens, out_features) and y.dtype == torch.float32
    if not layer.scheme.act.symmetric:
        # The activations' zero point enters as s_x z_x Σ_k Ŵ_k, subtracted in fp32 after the integer product.
        assert float((y - ref).abs().max() / ref.abs().max()) <= 1e-5
    elif layer.group_size >= in_features:
        # One exact integer sum a row, scaled in the reference's order: the same bits.
        assert torch.equal(y, ref)
    else:
        # Exact int32 sums per group; only the fp32 sum over groups may round in another order.
        assert float((y - ref).abs().max() / ref.abs().max()) <= 1e-6


def test_w4a8_tiles_hold_eight_columns_of_sixteen_channels_per_64_bytes():
    from llmeasyquant.kernels.cpu import tile_int4_codes

    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(17, 2)[:17, :13]  # 17 channels x 13 columns
    codes[5, 9] = 7
    tiled = tile_int4_codes(codes)
    assert tiled.shape == (2, 2, 16, 4) and tiled.dtype == torch.uint8
    # Channel 5, block 1 (columns 8..15): byte c holds column 8 + c low and 12 + c high, as code + 8.
    lane = tiled[0, 1, 5]
    assert [int(b) & 15 for b in lane] == [int(codes[5, 8 + c]) + 8 for c in range(4)]
    assert [int(b) >> 4 for b in lane[:1]] == [int(codes[5, 12]) + 8]
    assert int(lane[1]) & 15 == 15  # the 7 written at column 9
    # Padding: columns 13..15 and channels 17..31 hold u = 8 (code 0).
    assert [int(b) >> 4 for b in lane[1:]] == [8, 8, 8]
    assert bool((tiled[1, :, 1:] == 0x88).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_activation_groups_round_closer_to_the_float_layer_than_one_scale_a_token(bits):
    """Each 64 channels of a token on their own range: the outlier channels (make_input's every 13th) widen only
    their groups' steps, so the integer product lands nearer the float activations' product with the same 4-bit
    weights."""
    weight, bias = make_weight(576, 192, seed=5)
    x = make_input(16, 576)
    layers = [QuantLinear.from_weight(weight, bias, parse_scheme(name)) for name in (f"w4a{bits}-g64",
                                                                                     f"w4a{bits}-ag64-g64")]
    exact = x @ layers[0].dequantize().t() + bias  # the weights' rounding is the same for both
    errors = [rel_rms_err(layer(x), exact) for layer in layers]
    assert errors[1] < 0.9 * errors[0]


@pytest.mark.parametrize("scheme_name", ["w8a8", "w8a16", "w4a16-g128-asym", "w3a16-g32", "w4a8-g64"])
def test_kernels_are_not_trivially_close(scheme_name):
    """Guard against a vacuous comparison: the reference output differs from a wrong weight's output."""
    layer, reference = layer_pair(scheme_name, 576, 192)
    x = make_input(7, 576)
    wrong = QuantLinear.from_weight(*make_weight(576, 192, seed=12345), parse_scheme(scheme_name))
    assert rel_rms_err(wrong(x), reference(x)) > 0.5
    assert rel_rms_err(layer(x), reference(x)) <= 1e-2


@pytest.mark.parametrize("scheme_name", ["w8a16", "w8a8", "w4a16-g64", "w4a16-g128-asym", "w2a16-g64-asym",
                                         "w4a8-g64-asym", "w8a8-g100-aasym"])
def test_reference_kernel_is_close_to_the_float_layer(scheme_name):
    """The oracle itself computes the linear layer: close to x @ W^T + b, closer with more bits."""
    _, reference = layer_pair(scheme_name, 576, 192)
    weight, bias = make_weight(576, 192, seed=576 * 1000 + 192)  # the weight layer_pair used
    x = make_input(7, 576)
    exact = x @ weight.t() + bias
    # w8a8 also rounds the activations (per token, with outlier channels), hence its larger budget.
    limit = {"w8a16": 0.03, "w8a8": 0.05, "w4a16-g64": 0.2, "w4a16-g128-asym": 0.2, "w2a16-g64-asym": 0.8,
             "w4a8-g64-asym": 0.2, "w8a8-g100-aasym": 0.05}[scheme_name]
    assert rel_rms_err(reference(x), exact) <= limit


# registry -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("scheme_name", "in_features", "expected"),
    [
        ("w8a8", 576, INT_MM),
        ("w8a8", 100, INT_MM),
        ("w8a8-asym", 48, INT_MM),
        ("w8a16", 576, W8_WIDE),
        ("w8a16", 64, W8_WIDE),
        ("w8a16", 100, W8_ODD),  # in % 16 != 0: the int8pack bf16 path would crash
        ("w8a16-asym", 100, W8_ODD),
        ("w8a16-pt", 64, W8_WIDE),  # per-tensor weights are per-row too
        ("w8a16-g128", 64, W8_WIDE),  # one group covers the whole row
        ("w8a16-g64", 576, REFERENCE),
        ("w8a8-g64", 576, REFERENCE),
        ("w4a16-g32", 576, W4),
        ("w4a16-g64", 100, W4),
        ("w4a16-g128", 576, W4),
        ("w4a16-g256", 576, W4),
        ("w4a16", 100, W4),
        ("w4a16-pt", 64, W4),
        ("w3a16-g32", 48, INT4PACK),
        ("w2a16-g64-asym", 576, INT4PACK),
        ("w4a16-g16", 576, W4_OTHER_GROUP),
        ("w4a16-g48", 576, W4_OTHER_GROUP),
        ("w4a16-g33", 576, REFERENCE),  # an odd group starts mid-byte
        ("w4a8-g128", 576, W4A8),
        ("w4a8-g128", 64, W4A8),
        ("w4a8-g12", 576, REFERENCE),  # groups must hold whole blocks of 8 columns
        ("w4a8-g64-aasym", 576, W4A8),  # asymmetric activations: a rank-1 correction after the kernel
    ],
)
def test_registry_choice(scheme_name, in_features, expected):
    weight, bias = make_weight(in_features, 32, seed=3)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme(scheme_name))
    assert select(layer).name == expected
    assert layer.kernel().name == expected
    assert f"kernel by rows=(1: {expected})" in repr(layer)
    # Whatever was chosen runs and agrees with the reference.
    reference = QuantLinear.from_weight(weight, bias, parse_scheme(scheme_name))
    reference.kernel_name = REFERENCE
    x = make_input(3, in_features)
    assert rel_rms_err(layer(x), reference(x)) <= 1e-2


def test_int8_operator_is_not_offered_codes_off_a_16_byte_boundary():
    # aten._weight_int8pack_mm segfaults on such codes; a checkpoint read from safetensors can hold them.
    from llmeasyquant.kernels.cpu import INT8PACK_ALIGNMENT, Int8WeightOnlyKernel

    weight, bias = make_weight(2048, 64, seed=4)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme("w8a16"))
    reference = QuantLinear.from_weight(weight, bias, parse_scheme("w8a16"))
    reference.kernel_name = REFERENCE
    assert Int8WeightOnlyKernel().supports(layer)
    shifted = torch.empty(layer.qweight.numel() + 64, dtype=torch.int8)
    offset = next(k for k in range(1, 64) if (shifted.data_ptr() + k) % INT8PACK_ALIGNMENT)
    shifted[offset:offset + layer.qweight.numel()] = layer.qweight.flatten()
    layer.qweight = shifted[offset:offset + layer.qweight.numel()].view_as(layer.qweight)
    layer.forget_kernel()
    assert not Int8WeightOnlyKernel().supports(layer)
    for rows in (1, 16):  # the registry times its candidates on these rows: none of them may crash
        x = make_input(rows, 2048)
        assert layer.kernel(rows).name != INT8PACK
        assert rel_rms_err(layer(x), reference(x)) <= 1e-2


def test_env_forces_reference(monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "reference")
    weight, bias = make_weight(576, 64, seed=1)
    x = make_input(7, 576)
    for name in ["w8a8", "w8a16", "w4a16-g128"]:
        layer = QuantLinear.from_weight(weight, bias, parse_scheme(name))
        assert layer.kernel().name == REFERENCE
        if layer.scheme.act is None:  # weight-only reference: exactly the float matmul with the dequantized weight
            torch.testing.assert_close(layer(x), x @ layer.dequantize().t() + bias, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(layer(x), x @ layer.dequantize().t() + bias)  # activations are rounded too


def test_env_forces_a_named_kernel(monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", INT4PACK)
    weight, bias = make_weight(576, 64, seed=1)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme("w4a16-g64"))
    assert layer.kernel().name == INT4PACK


def test_layer_kernel_name_wins_over_env(monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", INT_MM)
    weight, bias = make_weight(64, 16, seed=1)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme("w8a8"))
    layer.kernel_name = REFERENCE
    assert layer.kernel().name == REFERENCE


@pytest.mark.parametrize("forced", ["fast", "cuda", "Reference", "cpu_int4pack"])
def test_unknown_forced_kernel(monkeypatch, forced):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", forced)
    weight, bias = make_weight(64, 16, seed=1)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme("w8a16"))
    with pytest.raises(ConfigError, match="unknown kernel") as info:
        layer.kernel()
    assert repr(forced) in str(info.value)
    for name in ALL_KERNELS:  # the message lists what exists
        assert name in str(info.value)


def test_unknown_kernel_name_on_layer():
    weight, bias = make_weight(64, 16, seed=1)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme("w8a16"))
    layer.kernel_name = "triton"
    with pytest.raises(ConfigError, match="unknown kernel"):
        layer(make_input(1, 64))


@pytest.mark.parametrize(
    ("forced", "scheme_name", "in_features"),
    [
        (INT4PACK, "w8a16", 64),
        (INT_MM, "w8a16", 64),
        (INT_MM, "w4a16-g64", 64),
        (INT8PACK, "w8a8", 64),
        (INT8PACK, "w8a16", 100),  # the width the operator cannot handle
        (INT8PACK, "w8a16-g64", 576),
        (INT4PACK, "w4a8-g128", 576),
        (INT4PACK, "w4a16-g48", 576),
    ],
)
def test_forced_kernel_that_cannot_run_the_layer(monkeypatch, forced, scheme_name, in_features):
    weight, bias = make_weight(in_features, 16, seed=1)
    layer = QuantLinear.from_weight(weight, bias, parse_scheme(scheme_name))
    layer.kernel_name = forced
    with pytest.raises(ConfigError, match="cannot run") as info:
        layer.kernel()
    assert scheme_name in str(info.value) and str(in_features) in str(info.value)
    # The same through the environment.
    layer.kernel_name = None
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", forced)
    with pytest.raises(ConfigError, match="cannot run"):
        layer(make_input(1, in_features))


def test_empty_env_means_registry_choice(monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "")
    weight, bias = make_weight(64, 16, seed=1)
    assert QuantLinear.from_weight(weight, bias, parse_scheme("w8a8")).kernel().name == INT_MM


# QuantLinear ----------------------------------------------------------------------------------------------------
ALL_SCHEMES = W8A8_SCHEMES + WEIGHT_ONLY_SCHEMES + ["w8a16-pt", "w4a8-g128", "w8a16-g64"]


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 64), (100, 33), (33, 8)])
@pytest.mark.parametrize("scheme_name", ALL_SCHEMES)
def test_dequantize_is_within_half_a_step(scheme_name, in_features, out_features):
    weight, bias = make_weight(in_features, out_features, seed=5)
    scheme = parse_scheme(scheme_name)
    layer = QuantLinear.from_weight(weight, bias, scheme)
    back = layer.dequantize()
    assert back.shape == weight.shape and back.dtype == torch.float32
    group = min(scheme.group_size or in_features, in_features)
    columns = torch.arange(in_features) // group
    scale = layer.scales.float()[:, columns]  # [out, in]: each weight against its own group's scale
    err = (back - weight).abs()
    assert bool((err <= scale * (0.5 + 1e-4)).all()), float((err / scale).max())
    # The steps are fine enough to matter: relative error of the whole weight.
    limit = {8: 0.03, 4: 0.35, 3: 0.45, 2: 0.7}[scheme.bits]
    assert float((back - weight).norm() / weight.norm()) <= limit


@pytest.mark.parametrize(
    ("scheme_name", "in_features", "out_features", "qweight_shape", "groups"),
    [
        ("w8a16", 576, 192, (192, 576), 1),
        ("w8a8-asym", 100, 33, (33, 100), 1),
        ("w8a16-g64", 576, 192, (192, 576), 9),
        ("w4a16-g128", 576, 192, (192, 288), 5),  # partial last group: 4.5 -> 5
        ("w4a16-g128-asym", 100, 33, (33, 50), 1),  # group larger than the row
        ("w4a16-g32", 33, 8, (8, 17), 2),  # odd width: ceil(33 / 2) bytes
        ("w3a16-g32", 48, 8, (8, 18), 2),  # 3 bits dense: 8 codes in 3 bytes
        ("w3a16-g32", 50, 8, (8, 21), 2),  # a partial run of 8 codes takes whole bytes
        ("w2a16-g64-asym", 1536, 16, (16, 384), 24),  # 4 codes per byte
        ("w4a16", 576, 16, (16, 288), 1),
    ],
)
def test_storage_layout(scheme_name, in_features, out_features, qweight_shape, groups):
    weight, bias = make_weight(in_features, out_features, seed=2)
    scheme = parse_scheme(scheme_name)
    layer = QuantLinear.from_weight(weight, bias, scheme)
    expected_dtype = torch.int8 if scheme.bits == 8 else torch.uint8
    assert layer.qweight.dtype == expected_dtype
    assert tuple(layer.qweight.shape) == qweight_shape
    assert layer.scales.dtype == torch.float16 and tuple(layer.scales.shape) == (out_features, groups)
    state = layer.state_dict()
    if scheme.symmetric:
        assert layer.zeros is None and "zeros" not in state
    else:
        assert layer.zeros.dtype == torch.int8 and tuple(layer.zeros.shape) == (out_features, groups)
        assert "zeros" in state
    assert {"qweight", "scales", "bias"} <= set(state)
    per_row = {8: in_features, 4: math.ceil(in_features / 2)}.get(scheme.bits, math.ceil(in_features / 8) * scheme.bits)
    code_bytes = out_features * per_row
    expected_bytes = code_bytes + out_features * groups * 2 + (0 if scheme.symmetric else out_features * groups)
    assert layer.storage_bytes() == expected_bytes == layer_storage_bytes(in_features, out_features, scheme)
    # The codes view unpacks back to the signed domain, in range.
    codes = layer.codes()
    qmin, qmax = qrange(scheme.bits)
    assert codes.dtype == torch.int8 and tuple(codes.shape) == (out_features, in_features)
    assert int(codes.min()) >= qmin and int(codes.max()) <= qmax


def test_storage_bytes_known_values():
    weight, _ = make_weight(576, 192, seed=2)
    assert QuantLinear.from_weight(weight, None, parse_scheme("w8a16")).storage_bytes() == 192 * 576 + 192 * 2
    # 192 * 288 packed bytes + 192 * 5 fp16 scales + 192 * 5 int8 zeros
    assert QuantLinear.from_weight(weight, None, parse_scheme("w4a16-g128-asym")).storage_bytes() == 58176
    assert QuantLinear.from_weight(weight, None, parse_scheme("w4a16-g128")).storage_bytes() == 57216


@pytest.mark.parametrize("scheme_name", ["w8a8", "w8a16", "w4a16-g64", "w4a8-g128"])
def test_3d_input_shape(scheme_name):
    layer, _ = layer_pair(scheme_name, 64, 48)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    assert y.shape == (2, 5, 48)
    torch.testing.assert_close(y, layer(x.reshape(10, 64)).reshape(2, 5, 48), rtol=0, atol=0)
    assert layer(torch.randn(1, 1, 3, 64)).shape == (1, 1, 3, 48)


@pytest.mark.parametrize("scheme_name", ["w8a8", "w8a16", "w4a16-g32", "w4a8-g32", "w4a8-ag32-g32",
                                         "w4a4-aasym-ag32-g32-asym", "w4a4-g64"])
def test_zero_rows_give_an_empty_output(scheme_name):
    # A serving step of prompt rows only asks the LM head for no logits; W4A8 with activation groups once raised.
    layer, reference = layer_pair(scheme_name, 64, 48)
    for module in (layer, reference):
        assert module(torch.zeros(0, 64)).shape == (0, 48)
        y = module(torch.zeros(2, 0, 64, dtype=torch.bfloat16))
        assert y.shape == (2, 0, 48) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("scheme_name", ["w8a8", "w8a16", "w4a16-g64", "w2a16-g64-asym"])
def test_bias_is_added(scheme_name):
    weight, bias = make_weight(64, 48, seed=9)
    scheme = parse_scheme(scheme_name)
    with_bias = QuantLinear.from_weight(weight, bias, scheme)
    without = QuantLinear.from_weight(weight, None, scheme)
    assert without.bias is None and "bias" not in without.state_dict()
    torch.testing.assert_close(with_bias.bias, bias, rtol=0, atol=0)
    x = make_input(7, 64)
    torch.testing.assert_close(with_bias(x) - without(x), bias.expand(7, 48), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme_name", ["w8a8", "w8a16", "w4a16-g128", "w4a8-g128"])
def test_half_precision_input_gives_same_dtype(scheme_name, dtype):
    layer, reference = layer_pair(scheme_name, 576, 192)
    x = make_input(7, 576)
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (7, 192)
    assert rel_rms_err(y.float(), reference(x)) <= 2e-2


def test_from_weight_rejects_nan():
    weight, bias = make_weight(64, 16, seed=1)
    weight[3, 5] = float("nan")
    with pytest.raises(DataError, match=r"model\.layers\.0\.mlp\.down_proj"):
        QuantLinear.from_weight(weight, bias, parse_scheme("w8a16"), name="model.layers.0.mlp.down_proj")


def test_from_codes_rejects_mismatched_group():
    from llmeasyquant.primitives import choose_qparams, quantize

    weight, _ = make_weight(128, 16, seed=1)
    qp = choose_qparams(weight, 4, True, PerGroup(32))
    with pytest.raises(ValueError, match="group width"):
        QuantLinear.from_codes(quantize(weight, qp, 4), qp, parse_scheme("w4a16-g64"), None)


def test_state_dict_round_trip_resets_the_kernel():
    weight, bias = make_weight(576, 64, seed=4)
    scheme = parse_scheme("w4a16-g128-asym")
    source = QuantLinear.from_weight(weight, bias, scheme)
    x = make_input(7, 576)
    expected = source(x)
    target = QuantLinear(576, 64, scheme, bias=True)
    target(x)  # prepares the kernel from the empty buffers
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(target.dequantize(), source.dequantize(), rtol=0, atol=0)


def test_fast_per_token_quantization_is_bit_identical_to_the_primitives():
    from llmeasyquant.kernels.cpu import quantize_rows_symmetric
    from llmeasyquant.primitives import choose_qparams, quantize
    from llmeasyquant.scheme import PerToken

    torch.manual_seed(3)
    x = torch.randn(9, 77) * torch.logspace(-3, 3, 9)[:, None]
    x[0] = 0.0  # an all-zero token: the smallest scale, all codes 0
    x[1, :4] = torch.tensor([127.0, 63.5, -0.5, 1.5])  # exact ties: round half to even, as torch.round does
    x[2] = -x[2].abs()  # only negatives: the range still includes zero
    codes, scale = quantize_rows_symmetric(x)
    qp = choose_qparams(x, 8, True, PerToken(), scale_dtype=None)
    assert torch.equal(scale, qp.scale) and torch.equal(codes, quantize(x, qp, 8))


@pytest.mark.parametrize("bits", [8, 4])
def test_fast_per_token_quantization_needs_no_clamp(bits):
    """The fast path leaves out the clamp to [-qmax - 1, qmax]: on rows spanning 60 orders of magnitude, rows so
    small that the minimum scale applies, and each row's extreme on either sign, the codes equal the clamped ones."""
    from llmeasyquant.kernels.cpu import quantize_rows_symmetric
    from llmeasyquant.primitives import MIN_SCALE, choose_qparams, quantize
    from llmeasyquant.scheme import PerToken

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6000, 33, generator=gen) * torch.logspace(-30, 30, 6000)[:, None]
    qmax = 2 ** (bits - 1) - 1
    x[:500] = torch.rand(500, 33, generator=gen) * qmax * MIN_SCALE * 1.01  # around where the scale's floor binds
    x[::3, 0] = -x[::3].abs().amax(dim=1) * 1.0000001  # the extreme negative, beyond every other value
    codes, _ = quantize_rows_symmetric(x, bits)
    assert torch.equal(codes, quantize(x, choose_qparams(x, bits, True, PerToken(), scale_dtype=None), bits))
    assert int(codes.min()) >= -qmax - 1 and int(codes.max()) <= qmax


@pytest.mark.parametrize("scheme_name", ["w4a8-g64-asym", "w8a8-g100-aasym"])
def test_group_wise_integer_reference_equals_its_dequantized_form(scheme_name):
    """The exact integer product per group equals dequantized activations times the dequantized weight, to fp32
    rounding: the grouping, the zero points and the partial last group are handled right."""
    from llmeasyquant.primitives import dequantize, quantize

    _, reference = layer_pair(scheme_name, 576, 192)
    x = make_input(7, 576)
    qp = reference.activation_qparams(x)
    dequantized = dequantize(quantize(x, qp, reference.scheme.act.bits), qp) @ reference.dequantize().t()
    y = reference(x) - reference.bias
    assert rel_rms_err(y, dequantized) <= 1e-6


@pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")
@pytest.mark.parametrize("scheme_name", ["w4a16", "w4a16-g32", "w4a16-g64-asym"])
def test_bf16_prompt_kernel_rounds_to_bf16_only(scheme_name):
    """cpu_bf16_w4a16: the reference's weight and the activations in bf16, sums rounded to bf16 (as PyTorch's int4
    operator gives them): within bf16's rounding of the reference, not equal to it; uniform 4-bit codes only."""
    layer, reference = layer_pair(scheme_name, 576, 96)
    layer.kernel_name = "cpu_bf16_w4a16"
    x = make_input(40, 576)
    y, ref = layer(x), reference(x)
    assert not torch.equal(y, ref) and rel_rms_err(y, ref) <= 1e-2
    expected = (x.bfloat16().float() @ reference.dequantize().bfloat16().float().t()).bfloat16().float()
    torch.testing.assert_close(y - layer.bias, expected, rtol=2**-7, atol=1e-3)  # one bf16 step, another sum order
    assert not ALL_KERNELS["cpu_bf16_w4a16"].supports(QuantLinear.from_weight(*make_weight(576, 96, seed=1),
                                                                              parse_scheme("w4a16-g64-nf4")))
