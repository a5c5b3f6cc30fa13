"""The Triton kernels as the registry sees them (supports / prepare / run), importable without triton: the kernel
modules, which import triton at the top, are imported only when a layer is prepared."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmeasyquant.kernels.kernel import StepCall
from llmeasyquant.kernels.triton.launch import can_launch
from llmeasyquant.scheme import ActMode, PerToken

if TYPE_CHECKING:
    from llmeasyquant.kernels.triton.w4a16 import PreparedInt4Weight
    from llmeasyquant.kernels.triton.w8a8 import PreparedInt8Weight


class TritonW8A8Kernel:
    """W8A8 (the paper's Algorithm 2): int8 activations quantized on the fly (per token, absmax in the kernel, or
    with a per-tensor static/dynamic scale), an int8 x int8 -> int32 GEMM and a dequantizing epilogue.

    Weights: one scale per row (per-channel or per-tensor), symmetric or asymmetric; activations symmetric or
    asymmetric. Zero points enter as rank-1 corrections of the int32 accumulator, as in the CPU kernel.
    """

    name = "triton_w8a8"

    def supports(self, layer) -> bool:
        act = layer.scheme.act
        return (layer.scheme.bits == 8 and act is not None and act.bits == 8 and layer.scales.shape[1] == 1
                and act.group_size is None and can_launch(layer.qweight))

    def prepare(self, layer) -> PreparedInt8Weight:
        from llmeasyquant.kernels.triton import w8a8

        return w8a8.prepare_weight(layer.qweight, layer.scales, layer.zeros)

    def run(self, layer, x: torch.Tensor, prepared: PreparedInt8Weight) -> torch.Tensor:
        from llmeasyquant.kernels.scopes import QUANTIZE_ACTIVATIONS, scope
        from llmeasyquant.kernels.triton import w8a8

        act = layer.scheme.act
        with scope(QUANTIZE_ACTIVATIONS):
            if act.mode is ActMode.DYNAMIC and isinstance(act.granularity, PerToken) and layer.input_scale is None:
                qx = w8a8.quantize_per_token(x, symmetric=act.symmetric)  # absmax (or min/max) in the kernel
            else:
                # Static, per-tensor or tracked scales: the layer decides them exactly as for the reference.
                qp = layer.activation_qparams(x)
                qx = w8a8.quantize_with_scale(x, qp.scale, qp.zero)
        return w8a8.int8_matmul(qx, prepared, out_dtype=torch.float32)

    def step_call(self, layer, prepared, rows: int) -> StepCall | None:
        return None  # the native step is the CPU's; on a GPU the Python forward launches the kernel


class TritonW4A16Kernel:
    """W4A16: packed 4-bit weights unpacked and scaled (per group or per channel, zero points when asymmetric)
    inside a GEMM against 16-bit activations with fp32 accumulation.

    `dtype` is what the activations are rounded to for the tensor cores: fp16 by default (11 significant bits;
    exact for a bf16 model's activations of magnitude 2^-14 to 65504); bf16 for models whose activations exceed
    fp16's range (65504), at 8 significant bits.
    """

    name = "triton_w4a16"

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        self.dtype = dtype

    def supports(self, layer) -> bool:
        # (code - zero) * scale in the kernel: uniform codes only, not a non-uniform grid's table.
        return (layer.scheme.bits == 4 and layer.scheme.act is None and layer.scheme.grid is None
                and can_launch(layer.qweight))

    def prepare(self, layer) -> PreparedInt4Weight:
        from llmeasyquant.kernels.triton import w4a16

        return w4a16.prepare_weight(layer.qweight, layer.scales, layer.zeros, layer.in_features, layer.group_size)

    def run(self, layer, x: torch.Tensor, prepared: PreparedInt4Weight) -> torch.Tensor:
        from llmeasyquant.kernels.triton import w4a16

        return w4a16.w4a16_matmul(x, prepared, dot_dtype=self.dtype, out_dtype=torch.float32)

    def step_call(self, layer, prepared, rows: int) -> StepCall | None:
        return None  # the native step is the CPU's; on a GPU the Python forward launches the kernel
