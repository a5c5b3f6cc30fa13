"""Non-uniform weight grids: a weight is table[code] * scale, the table 2^bits increasing levels on [-1, 1].

The rounding math of the grids (primitives.py calls it for schemes with a `grid`): the tables, the nearest level,
the per-group scale search and the per-row table fit. A code is the level's index minus half the level count, in the
signed domain of codes of its bits, so grid layers pack their codes exactly as uniform layers of the same bits do
(a 4-bit nibble = table index). The fixed tables have 16 levels (4 bits); a learned table has 8 (3 bits) or 16.

- nf4: NormalFloat (QLoRA): 8 positive and 7 negative levels at evenly spaced quantiles of a normal distribution,
  plus an exact zero, scaled to [-1, 1].
- iq4nl: llama.cpp's IQ4_NL table (`kvalues_iq4nl`, ggml-common.h), divided by 128, a power of two, rather than by
  its largest magnitude 127: a scale s then equals the block scale d = s / 128 of a GGUF IQ4_NL block exactly (scales
  are chosen so that s / 128 is an fp16 number), and d * kvalue is the very fp32 product (kvalue / 128) * s.
- learned: one table per output row, fitted by weighted 1-D Lloyd (k-means) iterations to the row's weights divided
  by their group scales, started from the NormalFloat levels of its size (deterministic: no random start to seed),
  stored in fp16.

Scales are symmetric (no zero point), one per group, stored in fp16 and may be negative (which mirrors the table:
llama.cpp's IQ4_NL quantizer does the same to put a group's largest value on the table's longer side). Each group's
scale is the one of a few candidates (its signed largest value mapped to either end of the table, shrunk by a few
factors, and the least-squares scale of the best one's codes) with the least (importance-weighted) squared error.
"""

from __future__ import annotations

import torch

from llmeasyquant.errors import ConfigError

# llama.cpp's IQ4_NL levels (ggml/src/ggml-common.h, kvalues_iq4nl; the gguf package's quants.IQ4_NL.kvalues).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4NL_DIVISOR = 128.0
LEVELS = 16  # the fixed tables' size
# Candidate scales are the group's signed absmax over a table end, times one of these (the largest values clipped a
# little when that rounds the rest better).
SCALE_FACTORS = (1.0, 0.96, 0.92, 0.88, 0.84, 0.8)
LLOYD_STEPS = 12
# Smallest positive fp16 value: a scale below it would round to zero when stored (primitives.MIN_SCALE).
_MIN_SCALE = 2.0**-24


def nf4_levels(count: int = LEVELS) -> torch.Tensor:
    """The `count` NormalFloat levels with an exact zero (16: NF4): the positive half at count / 2 quantiles of
    N(0, 1) between 1/2 and `offset`, the negative half at count / 2 - 1, each half scaled so its end is +-1.
    offset = 1 - (1/2count + 1/2(count - 1)) / 2 puts the end levels at the middle of the two outermost probability
    slices of count and count - 1 equal slices (QLoRA's 0.9677 for 16)."""
    offset = 1 - (1 / (2 * count) + 1 / (2 * (count - 1))) / 2
    half = count // 2
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1])
    levels = torch.cat((positive / positive.max(), torch.zeros(1, dtype=torch.float64), negative / positive.max()))
    return levels.sort().values.float()


def iq4nl_levels() -> torch.Tensor:
    return torch.tensor(IQ4NL_VALUES, dtype=torch.float32) / IQ4NL_DIVISOR


def level_count(grid: str, bits: int) -> int:
    """Levels in a table of `grid` for codes of `bits` bits."""
    return 2**bits if grid == "learned" else LEVELS


def grid_levels(grid: str, bits: int = 4) -> torch.Tensor:
    """The fixed table of `grid` as fp32 [16] (a learned grid's start: the NormalFloat levels of its size)."""
    if grid in ("nf4", "learned"):
        return nf4_levels(level_count(grid, bits))
    if grid == "iq4nl":
        return iq4nl_levels()
    raise ConfigError(f"unknown weight grid {grid!r}; choose nf4, iq4nl or learned")


def store_scale(scale: torch.Tensor, grid: str) -> torch.Tensor:
    """Scales rounded to what is stored (fp16), back in fp32, never smaller in magnitude than the least fp16 step.
    For iq4nl the fp16 number is s / 128 (GGUF's block scale), so s = 128 * fp16(s / 128) is exact in fp16 too."""
    sign = torch.where(scale < 0, -1.0, 1.0)
    magnitude = scale.abs().clamp(min=_MIN_SCALE)
    if grid == "iq4nl":
        d = (magnitude / IQ4NL_DIVISOR).to(torch.float16).float().clamp(min=_MIN_SCALE)
        return sign * d * IQ4NL_DIVISOR
    return sign * magnitude.to(torch.float16).float().clamp(min=_MIN_SCALE)


def _midpoints(levels: torch.Tensor) -> torch.Tensor:
    return ((levels[..., 1:] + levels[..., :-1]) / 2).contiguous()


def nearest_level(t: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the level nearest each value of t [rows, n]; levels [L] shared or [rows, L] per row,
    increasing. A value halfway between two levels takes the lower one."""
    if levels.dim() == 1 or levels.shape[0] == 1:
        return torch.bucketize(t.contiguous(), _midpoints(levels.reshape(-1)))
    return torch.searchsorted(_midpoints(levels), t.contiguous())


def _gather_levels(index: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """levels[index] for index [rows, n] and levels [L] / [1, L] / [rows, L]."""
    if levels.dim() == 1 or levels.shape[0] == 1:
        return levels.reshape(-1)[index]
    return torch.gather(levels, 1, index)


def _grouped(x: torch.Tensor, width: int) -> torch.Tensor:
    rows, cols = x.shape
    groups = -(-cols // width)
    return torch.nn.functional.pad(x, (0, groups * width - cols)).reshape(rows, groups, width)


def _group_error(x: torch.Tensor, imp: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted squared error [rows, groups], level index [rows, groups, width]) of grouped x with these scales."""
    rows, groups, width = x.shape
    t = (x / scale[..., None]).reshape(rows, -1)
    index = nearest_level(t, levels)
    value = _gather_levels(index, levels).reshape(rows, groups, width) * scale[..., None]
    return ((x - value).square() * imp).sum(dim=-1), index.reshape(rows, groups, width)


def choose_scales(x: torch.Tensor, levels: torch.Tensor, width: int, grid: str,
                  importance: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group scales [rows, groups] (fp32, stored-exact) for x [rows, cols] on `levels` ([L] or [rows, L]):
    of the candidates, the one with the least importance-weighted squared error (the first on ties)."""
    rows, cols = x.shape
    xg = _grouped(x.float(), width)
    imp = _grouped((torch.ones(cols) if importance is None else importance.float()).expand(1, cols), width)
    peak = xg.gather(-1, xg.abs().argmax(dim=-1, keepdim=True))[..., 0]  # signed largest value [rows, groups]
    ends = levels.reshape(-1, levels.shape[-1])[:, [0, -1]]  # [rows or 1, 2]
    best_scale = best_err = None
    for end in (ends[:, 1:2], ends[:, 0:1]):
        for factor in SCALE_FACTORS:
            scale = store_scale(peak * factor / end, grid)
            err, _ = _group_error(xg, imp, scale, levels)
            if best_err is None:
                best_scale, best_err = scale, err
            else:
                better = err < best_err
                best_scale, best_err = torch.where(better, scale, best_scale), torch.where(better, err, best_err)
    # The least-squares scale of the best candidate's codes: sum(imp x q) / sum(imp q^2).
    _, index = _group_error(xg, imp, best_scale, levels)
    q = _gather_levels(index.reshape(rows, -1), levels).reshape(xg.shape)
    denom = (imp * q.square()).sum(dim=-1)
    fitted = torch.where(denom > 0, (imp * xg * q).sum(dim=-1) / denom.clamp(min=1e-30), best_scale)
    fitted = store_scale(fitted, grid)
    err, _ = _group_error(xg, imp, fitted, levels)
    return torch.where(err < best_err, fitted, best_scale)


def fit_row_levels(x: torch.Tensor, scale: torch.Tensor, width: int, start: torch.Tensor,
                   importance: torch.Tensor | None = None, steps: int = LLOYD_STEPS) -> torch.Tensor:
    """A table per row [rows, L] (fp32, increasing) minimising sum imp * (x - level * scale)^2 over the levels for
    fixed group scales: weighted Lloyd on t = x / scale with weights imp * scale^2, from `start` ([L] or
    [rows, L]). A level that no value is nearest keeps its place."""
    rows, cols = x.shape
    count = start.shape[-1]
    s = scale.repeat_interleave(width, dim=1)[:, :cols]
    t = x.float() / s
    weight = (torch.ones(cols) if importance is None else importance.float())[None, :] * s.square()
    levels = start.float().reshape(-1, count).expand(rows, count).clone()
    offsets = (torch.arange(rows) * count)[:, None]
    for _ in range(steps):
        index = nearest_level(t, levels) + offsets
        mass = torch.zeros(rows * count).index_add_(0, index.reshape(-1), weight.reshape(-1))
        moment = torch.zeros(rows * count).index_add_(0, index.reshape(-1), (weight * t).reshape(-1))
        mass, moment = mass.reshape(rows, count), moment.reshape(rows, count)
        levels = torch.where(mass > 0, moment / mass.clamp(min=1e-30), levels).sort(dim=1).values
    return levels


def learned_params(x: torch.Tensor, width: int, importance: torch.Tensor | None = None, bits: int = 4
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [rows, groups], levels [rows, 2^bits]) of a learned grid, both fp16-exact: tables fitted to x divided
    by the group absmax and normalised to a largest magnitude of 1, scales searched on them, then the tables refitted
    for those scales."""
    absmax = _grouped(x.float().abs(), width).amax(dim=-1)
    start_scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    levels = fit_row_levels(x, start_scale, width, grid_levels("learned", bits), importance)
    levels = levels / levels.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    levels = levels.to(torch.float16).float()
    scale = choose_scales(x, levels, width, "learned", importance)
    levels = fit_row_levels(x, scale, width, levels, importance).to(torch.float16).float()
    return scale, levels


def grid_params(x: torch.Tensor, grid: str, width: int, importance: torch.Tensor | None = None, bits: int = 4
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [rows, groups] fp32, levels [1, L] or [rows, L] fp32) of x [rows, cols] on `grid` for codes of `bits`
    bits, fp16-exact."""
    if grid == "learned":
        return learned_params(x, width, importance, bits)
    levels = grid_levels(grid)
    return choose_scales(x, levels, width, grid, importance), levels[None, :]


def grid_codes(x: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """int8 codes (level index - L / 2) [rows, cols] of x given per-column scales [rows, cols] (expanded)."""
    return (nearest_level(x.float() / scale, levels) - levels.shape[-1] // 2).to(torch.int8)


def grid_values(codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """levels[code + L / 2] * scale, float32 [rows, cols], for per-column scales [rows, cols]."""
    return _gather_levels(codes.long() + levels.shape[-1] // 2, levels) * scale
