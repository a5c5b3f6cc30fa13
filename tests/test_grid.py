"""The non-uniform 4-bit grids: tables, nearest levels, scale search, learned tables, and through primitives."""

from __future__ import annotations

import pytest
import torch

from llmeasyquant.grid import (
    IQ4NL_VALUES,
    grid_levels,
    iq4nl_levels,
    nearest_level,
    nf4_levels,
    store_scale,
)
from llmeasyquant.primitives import choose_qparams, dequantize, quantize
from llmeasyquant.scheme import PerChannel, PerGroup


def _weight(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, 3] *= 10  # an outlier column, as real layers have
    return w


def _relative_error(w: torch.Tensor, grid: str | None, group: int = 64, symmetric: bool = True) -> float:
    qp = choose_qparams(w, 4, symmetric, PerGroup(group), grid=grid)
    return float((w - dequantize(quantize(w, qp, 4), qp)).square().sum() / w.square().sum())


def test_nf4_levels_are_qlora_normal_float_with_an_exact_zero():
    levels = nf4_levels()
    assert levels.shape == (16,)
    assert bool((levels[1:] > levels[:-1]).all())
    assert levels[0] == -1 and levels[-1] == 1 and levels[7] == 0
    # QLoRA's published NF4 values (bitsandbytes' table), to four decimals.
    expected = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]
    torch.testing.assert_close(levels, torch.tensor(expected), atol=1e-4, rtol=0)


def test_iq4nl_levels_are_llama_cpp_table_over_128():
    assert torch.equal(iq4nl_levels() * 128, torch.tensor(IQ4NL_VALUES, dtype=torch.float32))
    assert IQ4NL_VALUES[0] == -127 and IQ4NL_VALUES[-1] == 113
    # Exact in fp16 (the stored form of a learned table) and in fp32.
    assert torch.equal(iq4nl_levels().half().float(), iq4nl_levels())


def test_nearest_level_shared_and_per_row():
    levels = nf4_levels()
    t = torch.linspace(-1.2, 1.2, 97).reshape(1, -1)
    index = nearest_level(t, levels)
    brute = (t[..., None] - levels).abs().argmin(dim=-1)
    assert torch.equal(index, brute)
    per_row = torch.stack([levels, levels * 0.5])
    t2 = torch.cat([t, t])
    brute2 = (t2[..., None] - per_row[:, None, :]).abs().argmin(dim=-1)
    assert torch.equal(nearest_level(t2, per_row), brute2)


def test_iq4nl_scale_over_128_is_fp16_exact():
    scale = store_scale(torch.tensor([1e-3, -0.37, 2e-6, 0.0]), "iq4nl")
    d = scale / 128
    assert torch.equal(d.half().float(), d)
    assert torch.equal(scale.half().float(), scale)
    assert bool((scale != 0).all())


@pytest.mark.parametrize("grid", ["nf4", "iq4nl", "learned"])
def test_grid_beats_uniform_symmetric_on_bell_shaped_weights(grid):
    w = _weight()
    assert _relative_error(w, grid) < 0.75 * _relative_error(w, None)


def test_learned_grid_beats_fixed_grids():
    w = _weight()
    assert _relative_error(w, "learned") < min(_relative_error(w, "nf4"), _relative_error(w, "iq4nl"))


@pytest.mark.parametrize("grid", ["nf4", "iq4nl", "learned"])
def test_grid_codes_scales_and_tables(grid):
    w = _weight()
    qp = choose_qparams(w, 4, True, PerGroup(64), grid=grid)
    codes = quantize(w, qp, 4)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert qp.zero is None and qp.scale.shape == (48, 4)
    assert torch.equal(qp.scale.half().float(), qp.scale)  # stored exactly
    assert qp.levels.shape == ((48, 16) if grid == "learned" else (1, 16))
    if grid == "learned":
        assert torch.equal(qp.levels.half().float(), qp.levels)
        assert bool((qp.levels[:, 1:] >= qp.levels[:, :-1]).all())
    # Each value takes its nearest level: no other code gives a smaller error.
    rows = w.shape[0]
    levels = qp.levels.expand(rows, 16)
    scale = qp.scale.repeat_interleave(64, dim=1)
    candidates = levels[:, None, :] * scale[..., None]  # [rows, cols, 16]
    best = (w[..., None] - candidates).abs().amin(dim=-1)
    chosen = (w - dequantize(codes, qp)).abs()
    assert bool((chosen <= best + 1e-7).all())


@pytest.mark.parametrize("grid", ["nf4", "iq4nl", "learned"])
def test_grid_quantization_is_deterministic(grid):
    w = _weight(seed=3)
    a = choose_qparams(w, 4, True, PerGroup(64), grid=grid)
    b = choose_qparams(w.clone(), 4, True, PerGroup(64), grid=grid)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.levels, b.levels)
    assert torch.equal(quantize(w, a, 4), quantize(w, b, 4))


def test_grid_dequantize_is_level_times_scale():
    w = _weight(rows=4, cols=128)
    qp = choose_qparams(w, 4, True, PerChannel(), grid="nf4")
    codes = quantize(w, qp, 4)
    expected = nf4_levels()[codes.long() + 8] * qp.scale  # one scale a row
    assert torch.equal(dequantize(codes, qp), expected)


def test_importance_moves_error_off_important_columns():
    w = _weight(rows=32, cols=64)
    importance = torch.ones(64)
    importance[:8] = 100.0
    plain = choose_qparams(w, 4, True, PerChannel(), grid="nf4")
    weighted = choose_qparams(w, 4, True, PerChannel(), grid="nf4", importance=importance)

    def err(qp):
        return float((w - dequantize(quantize(w, qp, 4), qp))[:, :8].square().sum())

    assert err(weighted) < err(plain)


def test_grid_levels_unknown():
    with pytest.raises(Exception, match="unknown weight grid"):
        grid_levels("nf3")


# 3-bit learned tables ------------------------------------------------------------------------------------------

def test_normal_float_levels_of_eight_keep_an_exact_zero_and_the_ends():
    levels = nf4_levels(8)
    assert levels.shape == (8,) and bool((levels[1:] > levels[:-1]).all())
    assert levels[0] == -1 and levels[-1] == 1 and levels[3] == 0  # 4 positive levels, 3 negative
    assert torch.equal(grid_levels("learned", 3), levels)
    assert torch.equal(nf4_levels(), nf4_levels(16))


def test_three_bit_learned_grid_codes_and_tables():
    w = _weight()
    qp = choose_qparams(w, 3, True, PerGroup(64), grid="learned")
    codes = quantize(w, qp, 3)
    assert qp.levels.shape == (48, 8) and torch.equal(qp.levels.half().float(), qp.levels)
    assert int(codes.min()) >= -4 and int(codes.max()) <= 3
    scale = qp.scale.repeat_interleave(64, dim=1)
    assert torch.equal(dequantize(codes, qp), torch.gather(qp.levels, 1, codes.long() + 4) * scale)
    # Each value takes its nearest level of its row's table.
    best = (w[..., None] - qp.levels[:, None, :] * scale[..., None]).abs().amin(dim=-1)
    assert bool(((w - dequantize(codes, qp)).abs() <= best + 1e-7).all())


def test_three_bit_learned_grid_beats_uniform_three_bit_codes():
    w = _weight()

    def error(grid: str | None, symmetric: bool) -> float:
        qp = choose_qparams(w, 3, symmetric, PerGroup(64), grid=grid)
        return float((w - dequantize(quantize(w, qp, 3), qp)).square().sum() / w.square().sum())

    assert error("learned", True) < 0.8 * min(error(None, True), error(None, False))
    assert error("learned", True) > _relative_error(w, "learned")  # 8 levels lose more than 16


def test_three_bit_learned_grid_is_deterministic():
    w = _weight(seed=5)
    a, b = (choose_qparams(x, 3, True, PerGroup(64), grid="learned") for x in (w, w.clone()))
    assert torch.equal(a.scale, b.scale) and torch.equal(a.levels, b.levels)
