"""The Gram matrix Σ xᵀx of calibration batches, summed exactly (infra/exact_sum.py) in bounded memory.

An exact sum of whole [in, in] products holds two or three fp64 bins of the whole matrix, plus the product and two
cuts of it while a term is added: 40 bytes per entry, 2.7 GB at the 8192 inputs of a 1B model's down projection
and 8.2 GB at an 8B model's 14336. Two changes bound it:

- a batch's product is formed a panel of PANEL_COLUMNS columns at a time (x.t() @ x[:, panel]), each panel one
  term of its own exact sum, so the temporaries are a panel's;
- while the batches themselves take less memory than the bins would (4 bytes per token and input against at least
  16 per entry of H: fewer tokens than four times the inputs), they are kept as they come and the sum formed at the
  end one panel at a time, so only one panel's bins exist at once. Once kept batches outgrow that, they are folded
  into bins of every panel and later batches are added as they come.

Either way every term is the same panel product, cut the same way, so the bits of H do not depend on which of the
two held the batches, on the order of the batches, or on how they were shared out over ranks. The cuts run in one
native pass where the fused operators are built (kernels/native's `exact_cut_add`; exact, so the same bits): the
seven PyTorch passes over each panel took as long as the GEMM that made it (60 ms at an 8B model's 14336 inputs).
"""

from __future__ import annotations

import torch

from llmeasyquant.infra.exact_sum import CutAdd, ExactSum
from llmeasyquant.kernels.native import ops

PANEL_COLUMNS = 512  # columns of H formed at once; part of what fixes the bits (each panel's terms are cut alone)
_BIN_BYTES = 16  # two fp64 bins per entry: the least the exact bins of the whole matrix take


class ExactGram:
    """Σ xᵀx over batches x [tokens, width]; `add` batches, then `reduce` (a collective under torch.distributed).
    With `paired`, Σ xᵀy over pairs of batches of one shape (`add(x, y)`): the cross products of two streams."""

    def __init__(self, width: int, paired: bool = False) -> None:
        self.width, self.paired = width, paired
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.kept_bytes = 0
        self.panels: list[ExactSum] | None = None  # bins of every panel, once the kept batches outgrew them
        self.device = torch.device("cpu")  # the batches': H is formed where they are

    def _panel_sum(self, columns: slice) -> ExactSum:
        return ExactSum((self.width, columns.stop - columns.start), cut_add=_native_cut_add())

    def _columns(self) -> list[slice]:
        return [slice(start, min(start + PANEL_COLUMNS, self.width)) for start in range(0, self.width, PANEL_COLUMNS)]

    @staticmethod
    def _add_products(total: ExactSum, batch: torch.Tensor, other: torch.Tensor | None, columns: slice) -> None:
        total.add(batch.t() @ (batch if other is None else other)[:, columns])

    @torch.no_grad()
    def add(self, batch: torch.Tensor, other: torch.Tensor | None = None) -> None:
        """One batch [tokens, width] (fp32), and with `paired` the batch of the other stream it multiplies. Kept as a
        copy: the forward pass may reuse the tensor it read."""
        if batch.dim() != 2 or batch.shape[1] != self.width:
            raise ValueError(f"a batch of shape {tuple(batch.shape)} added to the Gram matrix of {self.width} inputs")
        if self.paired != (other is not None) or (other is not None and other.shape != batch.shape):
            raise ValueError("a paired Gram matrix takes two batches of one shape, an unpaired one a single batch")
        self.device = batch.device
        if self.panels is not None:
            for total, columns in zip(self.panels, self._columns(), strict=True):
                self._add_products(total, batch, other, columns)
            return
        self.kept.append((batch.detach().clone(), None if other is None else other.detach().clone()))
        self.kept_bytes += batch.numel() * batch.element_size() * (2 if self.paired else 1)
        if self.kept_bytes > _BIN_BYTES * self.width * self.width:
            self.panels = [self._panel_sum(c) for c in self._columns()]
            kept, self.kept = self.kept, []
            for held, held_other in kept:
                self.add(held, held_other)

    @torch.no_grad()
    def reduce(self, divisor: int) -> torch.Tensor:
        """Σ xᵀx / divisor [width, width] fp32 over every batch of every rank (each panel all-reduced in turn, so
        every rank must call it), each entry rounded once from the exact fp64 sum."""
        out = torch.empty(self.width, self.width, dtype=torch.float32, device=self.device)
        folded, self.panels = self.panels, None
        for columns in self._columns():
            # A folded panel's bins are freed once it is formed; kept batches need one panel's bins at a time.
            total = folded.pop(0) if folded is not None else self._panel_sum(columns)
            for batch, other in self.kept:
                self._add_products(total, batch, other, columns)
            total.all_reduce()
            out[:, columns] = (total.value() / divisor).float()
            del total
        self.kept = []
        return out


def _native_cut_add() -> CutAdd | None:
    native = ops()
    return None if native is None else native.exact_cut_add
