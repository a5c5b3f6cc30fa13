"""Freed heap memory goes back to the system on glibc, so a streamed run's resident size does not creep."""

from __future__ import annotations

import platform

import psutil
import pytest

from llmeasyquant.infra.memory import _libc, release_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_small_allocations_leave_the_resident_size() -> None:
    process = psutil.Process()
    assert _libc() is not None
    chunks = [bytearray(1 << 16) for _ in range(6400)]  # 64 KiB each (zeroed: resident), 400 MiB on the heap
    grown = process.memory_info().rss
    del chunks[:-1]  # the last one stays: the freed space lies below it, so free() alone returns none of it
    assert process.memory_info().rss > grown - (100 << 20)
    release_freed_memory()
    assert process.memory_info().rss < grown - (300 << 20)
