"""Kernel registry: an explicit table from device type to the kernels that can run a layer; which of them runs
is measured per shape and row count (kernels/choice.py); the reference kernel takes what none supports.

`LLMEASYQUANT_KERNEL=reference` (or a kernel's name) forces one kernel everywhere; `layer.kernel_name` forces
one for a single layer. A forced kernel that cannot run the layer is an error, not a silent fallback.
"""

from __future__ import annotations

import logging
import os

from llmeasyquant.errors import ConfigError
from llmeasyquant.kernels import choice
from llmeasyquant.kernels.cpu import (
    Bf16DequantInt4Kernel,
    Bf16TilesInt4Kernel,
    FloatInt8Int8Kernel,
    Int4WeightOnlyKernel,
    Int8DynamicActKernel,
    Int8WeightOnlyKernel,
    NativeInt4DigitsKernel,
    NativeInt4Int8Kernel,
    NativeInt4WeightOnlyKernel,
    NativeInt8Int8Kernel,
    NativeInt8WeightOnlyKernel,
)
from llmeasyquant.kernels.kernel import Kernel
from llmeasyquant.kernels.layer import KernelLayer
from llmeasyquant.kernels.reference import ReferenceKernel
from llmeasyquant.kernels.triton.layers import TritonW4A16Kernel, TritonW8A8Kernel

log = logging.getLogger(__name__)

REFERENCE = ReferenceKernel()
KERNELS_BY_DEVICE: dict[str, list[Kernel]] = {
    # The fused-operator weight-only kernels first: fp32 results; they are offered only where kernels/native.py builds.
    # torch._int_mm's W8A8 before the native one: `first` mode keeps the kernel that every row count runs fast; the
    # W4A16 fixed-point kernel after the fp32-activation one, so that `first` mode keeps 16 bits of every value.
    # The fp32-GEMM W8A8 kernel after the integer ones: `first` mode keeps exact int32 sums. The bf16 W4A16 kernels
    # last: `first` mode keeps 16 bits of every activation.
    "cpu": [Int8DynamicActKernel(), NativeInt8Int8Kernel(), FloatInt8Int8Kernel(), NativeInt4Int8Kernel(),
            NativeInt8WeightOnlyKernel(), Int8WeightOnlyKernel(), NativeInt4WeightOnlyKernel(),
            NativeInt4DigitsKernel(), Int4WeightOnlyKernel(), Bf16DequantInt4Kernel(), Bf16TilesInt4Kernel()],
    # Triton kernels; importable without triton, whose absence makes supports() say no.
    "cuda": [TritonW8A8Kernel(), TritonW4A16Kernel()],
}
ALL_KERNELS: dict[str, Kernel] = ({k.name: k for kernels in KERNELS_BY_DEVICE.values() for k in kernels}
                                  | {REFERENCE.name: REFERENCE})


def candidates(layer: KernelLayer) -> list[Kernel]:
    """Kernels that can run `layer` where its buffers live, in the registry's order; on the CPU a weight-only layer
    also has the reference kernel (a dequantize-then-GEMM for it), which wins at many rows (kernels/choice.py)."""
    device = layer.qweight.device.type
    found = [k for k in KERNELS_BY_DEVICE.get(device, []) if k.supports(layer)]
    if device == "cpu" and layer.scheme.act is None and found:
        found.append(REFERENCE)
    return found


def select(layer: KernelLayer, rows: int = 1) -> Kernel:
    """The kernel that will run `layer`, for inputs of `rows` rows, on the device its buffers live on."""
    forced = layer.kernel_name or os.environ.get("LLMEASYQUANT_KERNEL") or None
    if forced:
        if forced not in ALL_KERNELS:
            raise ConfigError(f"unknown kernel {forced!r}; choose one of {', '.join(sorted(ALL_KERNELS))}")
        kernel = ALL_KERNELS[forced]
        if not kernel.supports(layer):
            raise ConfigError(f"kernel {forced!r} cannot run a {layer.scheme.name} layer of width "
                              f"{layer.in_features}; unset the forced kernel to let the registry choose")
        return kernel
    found = candidates(layer)
    if found:
        if choice.is_pinned():  # calibration: the same kernel in every process, whatever the timings
            return REFERENCE if REFERENCE in found else found[0]
        if choice.mode() == "first":
            return found[0]
        return choice.choose(layer, choice.on_the_step_path(layer, found, rows), rows)
    log.debug("no integer kernel for %s (in=%d) on %s; using the reference kernel",
              layer.scheme.name, layer.in_features, layer.qweight.device.type)
    return REFERENCE
