"""Named profiler scopes around the parts of a quantized layer that are not the GEMM, for the latency breakdown
(eval/speed.py). Opened only while the profiler runs, so normal inference pays one cheap check."""

from __future__ import annotations

import contextlib

import torch

LOAD_WEIGHTS = "llmeasyquant::load_weights"
QUANTIZE_ACTIVATIONS = "llmeasyquant::quantize_activations"
NATIVE_GEMM = "llmeasyquant::native_gemm"  # a GEMM of kernels/native.py, which the profiler sees as no ATen op
LAYER_SCOPE = "llmeasyquant::layer::"  # + the layer's name in its block: one quantized layer's whole forward


def scope(name: str) -> contextlib.AbstractContextManager:
    # Inside torch.compile the scopes are left out: the check itself would split the compiled graph.
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
