"""Triton GPU kernels for QuantLinear, importable without triton installed.

`w8a8.py` and `w4a16.py` hold the kernels and import triton at the top; `layers.py` holds the classes the registry
sees, which import those modules only when a layer is prepared, so `supports()` can say no (triton missing, CPU
tensors) without them; `launch.py` says whether a kernel can launch here.

`@triton.jit` reads TRITON_INTERPRET when the kernel modules are imported: set it before the first prepare() to run
the kernels on CPU tensors in Triton's interpreter (what the tests do).
"""
