"""Giving freed memory back to the system, for the streamed runs whose peak memory is their point.

A block's packed tensors (tens of MB each) fall under glibc's mmap threshold, so once freed they stay in the heap
as free space that the process's resident size still counts: a streamed 8B quantization grew by about 50 MB per
block that way. `malloc_trim(0)` returns that free space (the heap's top, and whole free pages inside it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


def release_freed_memory() -> None:
    """Return the heap's free memory to the system where the C library can (glibc); elsewhere nothing."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
