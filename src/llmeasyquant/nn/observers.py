"""Observers: running estimates of a tensor's range while a model runs (online quantization)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ema_step(previous: torch.Tensor, observed: torch.Tensor, momentum: float) -> torch.Tensor:
    """δ_t = momentum·δ_{t-1} + (1 - momentum)·observed, where a NaN δ_{t-1} (nothing seen yet) takes `observed`
    outright. Pure tensor arithmetic: no host sync, so it costs a few element-wise ops per call."""
    blended = momentum * previous + (1 - momentum) * observed
    return torch.where(torch.isnan(previous), observed, blended)


def observed_extremes(x: torch.Tensor, symmetric: bool, eps: float, std_floor: bool) -> torch.Tensor:
    """[lo, hi] of one observation for the online activation range, each at least ε_t away from zero, with
    ε_t = eps, or max(eps, std(x)) with `std_floor` (a range never collapses onto a near-constant input)."""
    x = x.detach().float()
    floor = torch.full((), eps, device=x.device)
    if std_floor and x.numel() > 1:
        floor = torch.maximum(floor, x.std())
    if symmetric:
        hi = torch.maximum(x.abs().amax(), floor)
        return torch.stack((-hi, hi))
    return torch.stack((torch.minimum(x.amin(), -floor), torch.maximum(x.amax(), floor)))


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
            self.lo = ema_step(self.lo, lo.float(), self.momentum)
            self.hi = ema_step(self.hi, hi.float(), self.momentum)
        return self.lo, self.hi
