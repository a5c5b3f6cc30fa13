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


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_large_allocations_are_mapped_and_unmapped_on_their_own() -> None:
    import subprocess
    import sys

    # In a child: mallopt changes the whole process. 2 MiB chunks: under glibc's default (dynamic) threshold, once a
    # larger block was freed, they come from the heap and stay resident after free until a trim; mapped, they go.
    script = """
import psutil
from llmeasyquant.infra.memory import map_large_allocations
assert map_large_allocations()
process = psutil.Process()
big = bytearray(16 << 20); del big  # raises glibc's dynamic threshold to 16 MiB unless it is fixed
chunks = [bytearray(2 << 20) for _ in range(200)]
grown = process.memory_info().rss
del chunks[:-1]
print(grown - process.memory_info().rss)
"""
    freed = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert freed > 300 << 20
