"""Activation clipping before a layer's kernel (`--act-clip`): one fraction of each token's range, or the fraction,
among CLIP_SEARCH_FRACTIONS, that rounds the token with the least squared error (`--act-clip search`).

The search tries every fraction on every value of a token, so in PyTorch operators it costs six roundings of the
input, each a handful of operators over [fractions, rows, width] (4x slower prefill than one fraction on SmolLM2
at W4A4, docs/RESULTS.md); the fused C++ operator (native/decoder_ops.cpp, search_clip_rows) does it in one pass
per fraction over each row. `search_clip_reference` is the PyTorch version, used where the native operators are off
or for per-tensor clipping, and what the operator is tested against.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from llmeasyquant.kernels import native
from llmeasyquant.primitives import MIN_SCALE, clip_activations, grouped_view, qrange
from llmeasyquant.scheme import ActScheme, Granularity, PerTensor, PerToken

# The fractions of a token's range the search tries. 1.0 (min-max) is one, so no token rounds worse than unclipped;
# below 0.5 a 4-bit token would have to be far heavier-tailed than a rotated stream's.
CLIP_SEARCH_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
_FRACTIONS = torch.tensor(CLIP_SEARCH_FRACTIONS, dtype=torch.float32)  # made once: every decode step's layers read it


def search_clip_reference(x: torch.Tensor, bits: int, symmetric: bool, granularity: Granularity) -> torch.Tensor:
    """x with each token (row of the last dimension; the whole tensor per tensor) limited to the fraction of its
    range, among CLIP_SEARCH_FRACTIONS, whose `bits`-bit dynamic rounding leaves the least squared error (the first
    such fraction on a tie). Clipped as `clip_activations` clips, so the kernels need no change: the scale they
    compute from the result is the chosen one."""
    dims = tuple(range(x.dim())) if isinstance(granularity, PerTensor) else (x.dim() - 1,)
    xf = x.float()
    fractions = _FRACTIONS.to(x.device).reshape(-1, *([1] * x.dim()))
    qmin, qmax = qrange(bits)
    if symmetric:
        hi = torch.amax(xf.abs(), dim=dims, keepdim=True) * fractions  # [fractions, ...] over x's shape
        lo = -hi
        scale = (hi / qmax).clamp(min=MIN_SCALE)
        # Rounded as the kernel rounds the clipped input (so a clipped value never takes the extra negative code).
        rounded = torch.clamp(torch.round(torch.clamp(xf, lo, hi) / scale), qmin, qmax) * scale
    else:
        lo = torch.amin(xf, dim=dims, keepdim=True).clamp(max=0) * fractions
        hi = torch.amax(xf, dim=dims, keepdim=True).clamp(min=0) * fractions
        scale = ((hi - lo) / (qmax - qmin)).clamp(min=MIN_SCALE)
        zero = torch.round(qmin - lo / scale).clamp(qmin, qmax)
        rounded = (torch.clamp(torch.round(torch.clamp(xf, lo, hi) / scale) + zero, qmin, qmax) - zero) * scale
    error = (rounded - xf).square().sum(dim=tuple(d + 1 for d in dims), keepdim=True)
    best = error.argmin(dim=0, keepdim=True)  # argmin takes the first of equal errors: the widest range
    lo_best = torch.take_along_dim(lo, best, dim=0)[0]
    hi_best = torch.take_along_dim(hi, best, dim=0)[0]
    return torch.clamp(xf, lo_best, hi_best).to(x.dtype)


def search_clip_activations(x: torch.Tensor, bits: int, symmetric: bool, granularity: Granularity) -> torch.Tensor:
    """`search_clip_reference`'s clipping, by the native operator for per-token rows on the CPU where it is on (its
    sums run in another order, so a token whose two best fractions round within float error of each other may take
    the other one)."""
    ops = native.ops() if x.device.type == "cpu" and not isinstance(granularity, PerTensor) else None
    if ops is None:
        return search_clip_reference(x, bits, symmetric, granularity)
    rows = x.reshape(-1, x.shape[-1]).float()
    return ops.search_clip_rows(rows, bits, symmetric, _FRACTIONS, MIN_SCALE).reshape(x.shape).to(x.dtype)


@functools.cache
def _per_token(act: ActScheme) -> ActScheme:
    """`act` with one range a row: what each group, seen as a row, is clipped with (made once a scheme)."""
    return dataclasses.replace(act, granularity=PerToken())


def limit_activations(x: torch.Tensor, act: ActScheme) -> torch.Tensor:
    """x as a layer whose activations `act` describes hands it to its kernel: clipped to `act.clip` of each token's
    range (of each group's, with activation groups), or to the searched fraction (`act.clip_search`); x itself
    without clipping."""
    if act.group_size is not None:
        # Each group of a token is a row of its own: padded with zeros to whole groups (zero lies in every range and
        # rounds exactly, so padding neither widens a range nor adds error), clipped as tokens are, cut back.
        width = x.shape[-1]
        rows = grouped_view(x.reshape(-1, width), act.group_size)
        clipped = limit_activations(rows.reshape(-1, rows.shape[-1]), _per_token(act))
        return clipped.reshape(rows.shape[0], -1)[:, :width].reshape(x.shape)
    if act.clip_search:
        return search_clip_activations(x, act.bits, act.symmetric, act.granularity)
    return clip_activations(x, act.clip, act.symmetric, act.granularity)
