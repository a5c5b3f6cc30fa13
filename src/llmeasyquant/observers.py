"""Observers: running estimates of a tensor's range while a model runs (online quantization)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EMARangeObserver:
    """Per-channel [lo, hi] tracked with an exponential moving average: δ_t = α·δ_{t-1} + (1 - α)·ext(X_t).

    The first observation sets the range outright; later ones move it by a share (1 - α) towards their own
    extremes, so one unusual step neither collapses nor blows up the range.
    """

    momentum: float = 0.99
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"EMA momentum must lie in [0, 1), got {self.momentum}")

    def update(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold one observation's extremes (same shape as the range) in and return the tracked range."""
        if self.lo is None:
            self.lo, self.hi = lo.float().clone(), hi.float().clone()
        else:
            a = self.momentum
            self.lo = a * self.lo + (1 - a) * lo.float()
            self.hi = a * self.hi + (1 - a) * hi.float()
        return self.lo, self.hi
