"""What a kernel reads of a quantized layer: a protocol of the kernels' own, so that they never import the layer.

`nn.qlinear.QuantLinear` satisfies it; a kernel reads these attributes and calls nothing else on the layer except
`activation_qparams` for activation scales that the layer decides (static, per-tensor or tracked online).
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmeasyquant.scheme import QuantScheme


class KernelLayer(Protocol):
    qweight: torch.Tensor  # int8 [out, in], or int4 packed two per byte [out, ceil(in / 2)]
    scales: torch.Tensor  # fp16 [out, groups]
    zeros: torch.Tensor | None  # int8 [out, groups], None when symmetric
    levels: torch.Tensor | None  # fp16 [out, 16], a learned grid's tables (scheme.grid); None otherwise
    scheme: QuantScheme
    in_features: int
    out_features: int
    group_size: int | None
    bias: torch.Tensor | None  # fp32 [out], added after the kernel
    input_scale: torch.Tensor | None  # static or tracked activation scale
    kernel_name: str | None  # a kernel forced for this layer alone
