"""Quantized layers that read the same input (q/k/v, gate/up) run as one GEMM: fewer, larger kernel calls.

Which layers share an input is already in the architecture table: the linears one smoothing source feeds. The
members keep their buffers, as row views into the group's concatenated ones, so the state dict, checkpoints and
exports see the same tensors as before; only the forward changes: the first member called computes every
member's output in one kernel call, and the others return their slices when called with the same input tensor.
Each output column of a GEMM is computed on its own, so the results equal the unfused ones (tested bit for bit).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmeasyquant.infra.memory import release_freed_memory
from llmeasyquant.models.arch import arch_for, blocks_of, get_module
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.scheme import ActMode

log = logging.getLogger(__name__)

_SHARED_BUFFERS = ("qweight", "scales", "zeros", "levels", "bias")  # levels: a learned grid's tables, a row each


class SharedInputCall:
    """One GEMM for several QuantLinear layers that read the same input tensor."""

    def __init__(self, members: list[QuantLinear]) -> None:
        first = members[0]
        self.sizes = [m.out_features for m in members]
        self.combined = QuantLinear(first.in_features, sum(self.sizes), first.scheme, first.bias is not None,
                                    first.bias.dtype if first.bias is not None else torch.float32)
        for name in _SHARED_BUFFERS:
            parts = [getattr(m, name) for m in members]
            if parts[0] is None:
                continue
            joined = torch.cat(parts, dim=0)
            setattr(self.combined, name, joined)
            start = 0
            for member, size in zip(members, self.sizes, strict=True):
                setattr(member, name, joined[start:start + size])  # a view: the member's tensor lives here now
                start += size
        if first.input_scale is not None:
            self.combined.input_scale.copy_(first.input_scale)
            if first.input_zero is not None:
                self.combined.input_zero.copy_(first.input_zero)
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._pending: set[int] = set()

    def output(self, index: int, member: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if self.combined.kernel_name != member.kernel_name:  # follow a kernel forced on the members
            self.combined.kernel_name = member.kernel_name
            self.combined.forget_kernel()
        if x is not self._input or index not in self._pending:
            self._input = x
            self._outputs = torch.split(self.combined(x), self.sizes, dim=-1)
            self._pending = set(range(len(self.sizes)))
        self._pending.discard(index)
        out = self._outputs[index]
        if not self._pending:  # every member has its slice: let go of the input and the outputs
            self._input, self._outputs = None, ()
        return out


def _fusable(members: list[nn.Module]) -> bool:
    if len(members) < 2 or not all(isinstance(m, QuantLinear) for m in members):
        return False
    first = members[0]
    act = first.scheme.act
    # A layer that transforms its input online reads something the others do not (and the combined layer would not
    # apply it).
    same = all(m.scheme == first.scheme and m.in_features == first.in_features and m.shared is None
               and m.input_transform is None
               and m.kernel_name == first.kernel_name and (m.bias is None) == (first.bias is None)
               and m.qweight.device == first.qweight.device for m in members)
    # Online ranges are state of each layer; static scales must agree for one scale to serve all.
    scales_agree = first.input_scale is None or all(torch.equal(m.input_scale, first.input_scale) and (
        m.input_zero is None or torch.equal(m.input_zero, first.input_zero)) for m in members)
    return same and scales_agree and not (act is not None and act.mode is ActMode.ONLINE)


def fuse_shared_inputs(model: nn.Module) -> int:
    """Fuse, in every block, the quantized linears that read one input; returns how many groups were fused."""
    arch = arch_for(model)
    # Experts' linears read only the tokens routed to each: they share no input with one another.
    groups = [consumers for _, consumers in arch.smoothing
              if len(consumers) > 1 and not any(name.startswith(arch.routed) for name in consumers)]
    fused = 0
    for block in blocks_of(model):
        for names in groups:
            members = [get_module(block, name) for name in names]
            if _fusable(members):
                call = SharedInputCall(members)
                for index, member in enumerate(members):
                    member.shared = (call, index)
                fused += 1
    log.info("fused %d groups of layers that share an input", fused)
    # The members' own buffers are freed now; under glibc's mmap threshold they would stay counted in the heap
    # (0.8 GB of the 8B shape's q/k/v and gate/up).
    release_freed_memory()
    return fused
