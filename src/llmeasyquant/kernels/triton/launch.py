"""Whether Triton kernels can launch here: triton importable, CUDA tensors or the interpreter on; tile sizes for
the interpreter. A leaf module: the kernel modules and the registry's classes both read it."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)

# Small tiles for Triton's interpreter (CPU tests), where every program runs in Python; tl.dot needs >= 16.
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}


@functools.cache
def triton_available() -> bool:
    """triton is installed and imports (a broken install must not break the registry)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a missing shared library of a mismatched build
        log.debug("triton is installed but does not import: %s", exc)
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter is on: kernels then run on CPU tensors, in Python (slowly)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton without knobs: the same environment variable
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def can_launch(tensor: torch.Tensor) -> bool:
    """Compiled kernels need CUDA (or ROCm, also device type "cuda") tensors; the interpreter takes any."""
    return triton_available() and (tensor.is_cuda or interpreting())
