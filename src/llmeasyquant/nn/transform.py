"""An online input transform of a linear layer: the layer computes W T(x) where T is an orthogonal Hadamard-like
map applied to its input at run time (QuaRot's online Hadamard on the down-projection's input; methods/rotate.py
sets it up and folds T's transpose into W offline, so that W T(x) equals the original layer's output in float).

Where it lives: the layer owns it as a submodule named `input_transform`.
- A QuantLinear applies it in `forward`, before its kernel, so every path that runs the layer (evaluation, the
  lean decoder, the serving engine, calibration of later blocks) computes the same function.
- A float linear (before the quantizer swaps it) runs it from a forward pre-hook, so that every forward hook on it
  (the calibration statistics: GPTQ's Hessian, ranges) sees the transformed input, as its weights do.
`carry_input_transform` moves it onto the layer that replaces a linear; `transformed_input` is what the weights of a
layer read given the input a forward hook saw.
"""

from __future__ import annotations

import torch
from torch import nn

from llmeasyquant.kernels.hadamard import hadamard_matrix, hadamard_transform
from llmeasyquant.nn.qlinear import QuantLinear

ATTRIBUTE = "input_transform"


class HadamardTransform(nn.Module):
    """x [..., width] -> x diag(signs) (H ⊗ odd) / sqrt(width / m) (kernels/hadamard.py), in fp32.

    Buffers: `signs` fp32 [width] (±1) and `odd` fp32 [m, m] (orthogonal; [[1]] for a power-of-two width), both
    kept in fp32 in checkpoints (qlinear.FULL_PRECISION_STATE)."""

    def __init__(self, signs: torch.Tensor, odd: torch.Tensor) -> None:
        super().__init__()
        width, m = signs.numel(), odd.shape[0]
        power = width // m if m else 0
        if odd.shape != (m, m) or power * m != width or power < 1 or power & (power - 1):
            raise ValueError(f"a Hadamard transform of width {width} needs a square odd part whose order times a "
                             f"power of two is the width, got {tuple(odd.shape)}")
        self.register_buffer("signs", signs.detach().float().contiguous())
        self.register_buffer("odd", odd.detach().float().contiguous())

    @classmethod
    def empty(cls, width: int, odd_order: int) -> HadamardTransform:
        """One of the right shapes, for a checkpoint's state dict to fill."""
        return cls(torch.ones(width), torch.eye(odd_order))

    @property
    def width(self) -> int:
        return self.signs.numel()

    def describe(self) -> dict:
        """What a checkpoint records to rebuild it (the values come with the state dict)."""
        return {"kind": "hadamard", "width": self.width, "odd": self.odd.shape[0]}

    def matrix(self) -> torch.Tensor:
        """The dense matrix Q [width, width] (fp64) with T(x) = x Q: for tests and exporters."""
        return hadamard_matrix(self.signs, self.odd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(x, self.signs, self.odd)

    def extra_repr(self) -> str:
        return f"width={self.width}, odd={self.odd.shape[0]}"


def input_transform_of(module: nn.Module) -> HadamardTransform | None:
    """The online input transform `module` applies, or None."""
    return getattr(module, ATTRIBUTE, None)


def _transform_hook(module: nn.Module, args: tuple) -> tuple:
    return (getattr(module, ATTRIBUTE)(args[0]), *args[1:])


def attach_input_transform(module: nn.Module, transform: HadamardTransform) -> None:
    """Make `module` apply `transform` to its input: a QuantLinear in its forward, any other linear from a forward
    pre-hook (module docstring). A module that has one already is left as it is."""
    if input_transform_of(module) is not None:
        return
    setattr(module, ATTRIBUTE, transform)
    if not isinstance(module, QuantLinear):
        module.register_forward_pre_hook(_transform_hook)


def carry_input_transform(old: nn.Module, new: nn.Module) -> nn.Module:
    """Give `new`, which replaces `old`, the input transform `old` has (if any); returns `new`."""
    transform = input_transform_of(old)
    if transform is not None:
        attach_input_transform(new, transform)
    return new


def transformed_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the weights of `module` read, given the input x a forward hook on it saw: a float linear's pre-hook
    has transformed x already, a QuantLinear transforms inside forward, after the hooks were given x."""
    transform = input_transform_of(module)
    return transform(x) if transform is not None and isinstance(module, QuantLinear) else x
