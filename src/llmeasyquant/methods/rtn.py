"""Round to nearest: symmetric (AbsMax) or asymmetric (zero-point), at any granularity the scheme names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from llmeasyquant.methods.base import BlockContext, Quantizer, rtn_quant_linear
from llmeasyquant.models.arch import set_module


@dataclass(frozen=True)
class RTN(Quantizer):
    """Needs no calibration data: each weight group is rounded onto the grid its own min/max define."""

    name: ClassVar[str] = "rtn"
    needs_calibration: ClassVar[bool] = False
    default_scheme: ClassVar[str] = "w8a16"  # what --method rtn quantizes to when no scheme is given
    input_stats: ClassVar[frozenset[str]] = frozenset()
    float_path: ClassVar[bool] = False

    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        for rel_name, scheme in ctx.plan.items():
            layer = rtn_quant_linear(block.get_submodule(rel_name), scheme, ctx.prefix + rel_name)
            set_module(block, rel_name, layer)
