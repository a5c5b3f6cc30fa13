"""The engine's step in one native call: the model's blocks as a native program (kernels/native/native_step.cpp)
that runs every step's rows, decode rows and prompt chunks together, with no Python between the operators.

A program is built once per row bucket and thread count (the kernels chosen for a layer depend on both:
kernels/choice.py) and kept. Each linear of a block runs as its chosen kernel says it runs at that bucket
(`Kernel.step_call`, a kind of kernels/native/step_kinds.h); a block with a linear that has no such kind (an
online input transform, hooks, clipped activations or sink tokens, a grid's tables, a kernel that calls PyTorch's
general operators) steps on the Python forward of runtime/batch.py, which computes the same thing: consecutive
native blocks run as one call, so a model whose blocks all qualify (every scheme `serve` takes, on the families
with a `decoder` map and a native gated activation) runs its whole step as one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmeasyquant.kernels.choice import row_bucket
from llmeasyquant.kernels.kernel import StepArguments
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.primitives import MIN_SCALE
from llmeasyquant.runtime.kv_pool import KVPool
from llmeasyquant.runtime.model_parts import NO_NORM, DecoderParts, Linear


def linear_arguments(member: Linear, rows: int, kinds: dict[str, int]) -> StepArguments | None:
    """How the native step runs one member of a projection at `rows` rows, or None where it cannot: a QuantLinear's
    bound forward with nothing changing its input, through its chosen kernel's step call, or an fp32 nn.Linear."""
    layer, function = getattr(member, "__self__", None), getattr(member, "__func__", None)
    if isinstance(layer, QuantLinear) and function is QuantLinear.forward:
        act = layer.scheme.act
        if layer.input_transform is not None or layer.shared is not None or (act is not None and (act.sinks or
                                                                                                   act.clips)):
            return None
        kernel = layer.kernel(rows)
        call = kernel.step_call(layer, layer.prepared_for(kernel), row_bucket(rows))
        return None if call is None else call.arguments(layer, kinds)
    if type(layer) is nn.Linear and function is nn.Linear.forward and layer.weight.dtype == torch.float32:
        return kinds["float"], [layer.weight, None, None, None, layer.bias], [0, layer.in_features,
                                                                               layer.out_features, 0, 0, 0, 0]
    return None


@dataclass(frozen=True)
class NativeStep:
    """A built program and which of its blocks it runs: `runs` are (first, last, native) spans of blocks."""

    program: object  # the compiled module's StepProgram
    runs: tuple[tuple[int, int, bool], ...]

    @property
    def native_blocks(self) -> int:
        return sum(last - first for first, last, native in self.runs if native)


def build_step(parts: DecoderParts, pool: KVPool, rows: int) -> NativeStep | None:
    """The program for steps of `rows` rows (its bucket), or None where the fused operators do not cover the model
    (not fp32 with a native activation, or not built)."""
    ops = parts.fused_ops
    if ops is None:
        return None
    layout = pool.native_layout()
    program = ops.StepProgram(parts.heads, parts.scaling, layout.quantized, pool.tables, layout.cos, layout.sin,
                              layout.bits, layout.sinks, MIN_SCALE, ops.GATE_ACTIVATIONS[parts.activation])
    native = []
    for index, block in enumerate(parts.blocks):
        q_norm, k_norm = block.qk_norm or (NO_NORM, NO_NORM)
        program.add_block([block.attn_norm.weight, block.mlp_norm.weight, q_norm.weight, k_norm.weight],
                          [block.attn_norm.eps, block.mlp_norm.eps, q_norm.eps, k_norm.eps], layout.layers[index])
        found = [[linear_arguments(member, rows, ops.STEP_KINDS) for member in projection.members]
                 for projection in block.projections]
        qualifies = all(arguments is not None for members in found for arguments in members)
        if qualifies:
            for which, members in enumerate(found):
                for kind, tensors, ints in members:
                    program.add_linear(which, kind, tensors, ints)
        native.append(qualifies)
    runs, first = [], 0
    for index in range(1, len(native) + 1):
        if index == len(native) or native[index] != native[first]:
            runs.append((first, index, native[first]))
            first = index
    return NativeStep(program, tuple(runs))
