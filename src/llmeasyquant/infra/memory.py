"""Giving freed memory back to the system, for the streamed runs whose peak memory is their point; and memory on
2 MiB pages for the weights a decode step streams.

A block's packed tensors (tens of MB each) fall under glibc's mmap threshold, so once freed they stay in the heap
as free space that the process's resident size still counts: a streamed 8B quantization grew by about 50 MB per
block that way. `malloc_trim(0)` returns that free space (the heap's top, and whole free pages inside it).

glibc's threshold also moves: once a large mmapped block is freed, the threshold rises to its size (up to 32 MiB), so
later tensors of a few MB (a calibration sample's activations, a block's weights) come from the heap and their
memory stays counted after they are freed, until a trim. A streamed run fixes the threshold at 1 MiB
(`map_large_allocations`): each larger tensor is mapped and unmapped on its own, and the resident size is what is
live.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
LARGE_ALLOCATION = 1 << 20


def map_large_allocations() -> bool:
    """Give every allocation of LARGE_ALLOCATION bytes or more its own mapping, returned to the system when freed
    (glibc; elsewhere nothing). For the whole process: a streamed quantization's, whose peak memory is its point."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION))


def release_freed_memory() -> None:
    """Return the heap's free memory to the system where the C library can (glibc); elsewhere nothing."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def available_bytes() -> int | None:
    """Memory a new allocation can take without the out-of-memory killer: the kernel's MemAvailable plus free swap
    (Linux); None where /proc/meminfo does not say."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


HUGE_PAGE = 2 << 20  # bytes: the x86-64 and arm64 transparent huge page
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether anonymous memory can be asked for transparent huge pages here: Linux, with THP not set to never."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` zeroed bytes (uint8) from a 2 MiB boundary of a private anonymous mapping advised for transparent
    huge pages, or None where they are not available. The kernel backs each touched 2 MiB with one page where it
    has one free; the mapping lives as long as the tensor or any view of it."""
    if nbytes <= 0 or not huge_pages_available():
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped when the last view goes
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


class _HugePageArena:
    """Copies packed side by side into shared mappings of ARENA bytes on huge pages, 64-byte aligned: one mapping
    a copy would back each small one with a whole 2 MiB page (211 W4A16 layers of SmolLM2-135M, 76 MB of weights,
    would have taken up to 0.4 GB). A mapping lives as long as any copy in it."""

    ARENA = 32 * HUGE_PAGE

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: torch.Tensor | None = None  # the unused tail of the current mapping

    def take(self, nbytes: int) -> torch.Tensor | None:
        if nbytes >= self.ARENA // 4:  # large enough for a mapping of its own
            return huge_page_buffer(nbytes)
        with self._lock:
            if self._free is None or self._free.numel() < nbytes:
                self._free = huge_page_buffer(self.ARENA)
                if self._free is None:
                    return None
            taken, self._free = self._free[:nbytes], self._free[-(-nbytes // 64) * 64:]
            return taken


_ARENA = _HugePageArena()


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor on transparent huge pages (small ones packed together), or the tensor
    itself where they are not available: for what a kernel prepares after the weights were moved
    (nn/placement.py)."""
    buffer = _ARENA.take(tensor.numel() * tensor.element_size())
    if buffer is None:
        return tensor
    copy = buffer.view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy
