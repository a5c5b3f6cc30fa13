"""Sums whose value does not depend on the order of their terms: in one process, or split over ranks.

A float sum rounds at each addition, so the same terms added in another order (one process, against the partial
sums of several ranks all-reduced) can differ in the last bit, and a bit is enough to change codes: GPTQ's
act-order sorts columns by the Hessian's diagonal, AWQ and SmoothQuant take an argmin over a grid of errors.

Here each term is cut at fixed power-of-two boundaries into pieces that fp64 adds without rounding. Bin b holds
multiples of 2^(36 b) smaller than 2^(36 (b+1)); the sum of up to 2^17 such pieces needs at most 36 + 17 = 53
significant bits, what fp64 holds, so every addition into a bin is exact, in any order, on any rank, and through
the sum that all_reduce computes. The total is then formed from the bins in one fixed order (lowest first).

A term keeps its two highest bins: every bit from its largest entry's leading bit down by at least 36 bits
(1.5e-11 of that entry); smaller bits are dropped (truncated toward zero), the same way wherever the term is added.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from llmeasyquant.errors import ConfigError
from llmeasyquant.infra import distributed

BIN_BITS = 36
MAX_TERMS = 2 ** (53 - BIN_BITS)  # pieces per bin that fp64 still adds exactly
_LOWEST_BIN = -28  # 2^(36 · -28) = 2^-1008 is a normal fp64; bits below it are dropped
_HIGHEST_BIN = 28  # 2^(36 · 29) is beyond fp64's range: no finite value reaches a higher bin
_FP32_BINS = range(-2, 4)  # top bins whose two boundaries fp32 holds as normal numbers: pieces cut in fp32


# (fp32 term, high bin, low bin, high unit, low unit) -> None: adds the term's bits from the high unit down into the
# high bin and from the low unit down into the low bin, in place, as `ExactSum.add` does with PyTorch operators.
CutAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], None]


class ExactSum:
    """An order-independent sum of tensors of one shape; `add` terms, `all_reduce` over ranks, read `value()`.

    `cut_add` cuts fp32 terms in one pass instead (kernels/native's `exact_cut_add`, which methods/gram.py hands
    in): each step is exact, so the bits are the same either way."""

    def __init__(self, shape: Sequence[int], cut_add: CutAdd | None = None) -> None:
        self.shape = tuple(shape)
        self.cut_add = cut_add
        self.terms = 0
        self.bins: dict[int, torch.Tensor] = {}  # bin index -> fp64 sum of the pieces in it
        self.special: torch.Tensor | None = None  # the plain sum of terms holding inf or NaN (the total is then too)
        self.device = torch.device("cpu")  # the first term's: the bins stay where the terms are

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=torch.float64, device=self.device)

    def _bin(self, index: int) -> torch.Tensor:
        if index not in self.bins:
            self.bins[index] = self._zeros()
        return self.bins[index]

    @torch.no_grad()
    def add(self, term: torch.Tensor) -> None:
        if tuple(term.shape) != self.shape:
            raise ValueError(f"a term of shape {tuple(term.shape)} added to a sum of shape {self.shape}")
        if self.terms == 0:
            self.device = term.device
        self.terms += 1
        if self.terms > MAX_TERMS:
            raise ConfigError(f"more than {MAX_TERMS} terms in an exact sum (calibration samples or evaluation "
                              "windows): use fewer")
        x = term.detach().to(self.device)
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        top = float(x.abs().max()) if x.numel() else 0.0
        if not math.isfinite(top):
            self.special = x.double() if self.special is None else self.special + x.double()
            return
        if top == 0.0:
            return
        high = min(max((math.frexp(top)[1] - 1) // BIN_BITS, _LOWEST_BIN + 1), _HIGHEST_BIN)
        if x.dtype != torch.float32 or high not in _FP32_BINS:
            x = x.double()
        elif self.cut_add is not None and x.device.type == "cpu":
            self.cut_add(x, self._bin(high), self._bin(high - 1), math.ldexp(1.0, high * BIN_BITS),
                         math.ldexp(1.0, (high - 1) * BIN_BITS))
            return
        # Both cuts are exact (fmod by a power of two, and the differences, drop or keep bits, never round).
        rest = torch.fmod(x, math.ldexp(1.0, high * BIN_BITS))  # the bits below bin `high`
        piece = torch.sub(x, rest)
        self._bin(high).add_(piece)
        torch.fmod(rest, math.ldexp(1.0, (high - 1) * BIN_BITS), out=piece)  # the bits below bin `high - 1`
        self._bin(high - 1).add_(rest.sub_(piece))

    def all_reduce(self) -> None:
        """Sum the bins over all ranks (exact, so in whatever order the backend adds them); a no-op alone."""
        if not distributed.active():
            return
        present = torch.zeros(_HIGHEST_BIN - _LOWEST_BIN + 2, dtype=torch.int64)
        for index in self.bins:
            present[index - _LOWEST_BIN] = 1
        present[-1] = int(self.special is not None)
        present = distributed.all_reduce(present, "max")
        self.terms = int(distributed.all_reduce(torch.tensor(self.terms, dtype=torch.int64)))
        if self.terms > MAX_TERMS:
            raise ConfigError(f"more than {MAX_TERMS} terms in an exact sum over all ranks: use fewer")
        for offset in present[:-1].nonzero().flatten().tolist():
            index = offset + _LOWEST_BIN
            self.bins[index] = distributed.all_reduce(self._bin(index))
        if present[-1]:
            special = self.special if self.special is not None else self._zeros()
            self.special = distributed.all_reduce(special)

    def value(self) -> torch.Tensor:
        """The sum, fp64, from the bins in one fixed order: the same bins give the same bits."""
        total = self._zeros()
        for index in sorted(self.bins):
            total += self.bins[index]
        return total if self.special is None else total + self.special


def exact_totals(items: Sequence[Sequence[float]], width: int) -> list[float]:
    """Per component, the exact sum over every item of every rank (each item a vector of `width` floats): the same
    bits whichever rank held which items. A collective under torch.distributed: every rank calls it."""
    sums = [ExactSum(()) for _ in range(width)]
    for item in items:
        for total, value in zip(sums, item, strict=True):
            total.add(torch.tensor(float(value), dtype=torch.float64))
    for total in sums:
        total.all_reduce()
    return [float(total.value()) for total in sums]
