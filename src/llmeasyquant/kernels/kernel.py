"""What a kernel is: one class that says which layers it runs, prepares what it reads from a layer once, runs the
layer on a batch of rows, and says how the engine's native step runs it at a row count.

The registry (kernels/__init__.py) holds instances of such classes; kernels/choice.py times them. `step_call`
names one of the kinds of kernels/native/step_kinds.h (their one definition: the compiled module exports them as
STEP_KINDS) with the tensors that kind reads, so that runtime/native_step.py can run a block's linears inside one
native call; a kernel whose work at that row count is no such kind answers None, and its block steps on the Python
forward instead (the same result, slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmeasyquant.kernels.layer import KernelLayer


@dataclass(frozen=True)
class StepCall:
    """How the native step runs a layer: `kind` (a name of step_kinds.h) and its tensors a, b, c, d as that kind
    reads them; the activations' code range and group for the W4A8 kind; the input width its weights are padded to
    and the group size its operator takes, where they differ from the layer's."""

    kind: str
    tensors: tuple[torch.Tensor | None, ...]
    act_range: tuple[int, int] = (0, 0)
    act_group: int = 0
    padded_in: int = 0
    group_size: int | None = None

    def __post_init__(self) -> None:
        if len(self.tensors) > 4 or self.tensors[0] is None:
            raise ValueError(f"a step call takes its weight tensor and up to 3 more, got {len(self.tensors)}")

    def arguments(self, layer: KernelLayer, kinds: dict[str, int]) -> StepArguments:
        """The call as StepProgram.add_linear (and has_team_form) take it: the kind's number in `kinds` (the
        compiled module's STEP_KINDS), tensors a, b, c, d and the layer's bias, and seven ints."""
        tensors = [*self.tensors, *[None] * (4 - len(self.tensors)), layer.bias]
        ints = [self.group_size or layer.group_size or layer.in_features, layer.in_features, layer.out_features,
                *self.act_range, self.act_group, self.padded_in]
        return kinds[self.kind], tensors, ints


# One linear as StepProgram.add_linear takes it: its kind's number, tensors a, b, c, d and bias, and seven ints.
StepArguments = tuple[int, list[torch.Tensor | None], list[int]]


class Kernel(Protocol):
    name: str

    def supports(self, layer: KernelLayer) -> bool:
        """Whether this kernel can run `layer` (its scheme, shape and buffers)."""

    def prepare(self, layer: KernelLayer) -> Any:
        """What it reads besides the layer's buffers (repacked weights, scales), made once per layer."""

    def run(self, layer: KernelLayer, x: torch.Tensor, prepared: Any) -> torch.Tensor:
        """y [rows, out] fp32 for x [rows, in] fp32 (the bias is the layer's to add)."""

    def step_call(self, layer: KernelLayer, prepared: Any, rows: int) -> StepCall | None:
        """What `run` does for calls in the row bucket `rows`, as a native step kind; None where it is none."""
