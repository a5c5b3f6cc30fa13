"""Freed heap memory goes back to the system on glibc, so a streamed run's resident size does not creep; memory on
2 MiB pages where the system has them."""

from __future__ import annotations

import platform
from pathlib import Path

import psutil
import pytest
import torch

from llmeasyquant.infra import memory
from llmeasyquant.infra.memory import HUGE_PAGE, _libc, huge_page_buffer, huge_pages_available, release_freed_memory


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


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_huge_page_buffer_is_aligned_zeroed_and_advised() -> None:
    buffer = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buffer is not None and buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE + 100
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert not buffer.any()
    buffer[-1] = 7
    assert buffer[-1] == 7
    # The mapping that holds it is advised for huge pages ("hg" among its VmFlags in /proc/self/smaps).
    address, flags, inside = buffer.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            break
    assert flags is not None and "hg" in flags


def test_huge_page_buffer_refuses_where_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    assert memory.huge_page_buffer(HUGE_PAGE) is None
    assert memory.huge_page_buffer(0) is None


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_small_huge_page_copies_share_a_mapping_and_keep_their_values() -> None:
    """Small copies are packed side by side (64-byte aligned) rather than each backed by a 2 MiB page of its own."""
    first = torch.arange(1000, dtype=torch.int16).reshape(10, 100)
    second = torch.randn(7, 3)
    copies = [memory.huge_page_copy(first), memory.huge_page_copy(second)]
    assert torch.equal(copies[0], first) and torch.equal(copies[1], second)
    assert copies[0].data_ptr() != first.data_ptr() and copies[0].is_contiguous()
    assert copies[0].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr()
    assert copies[1].data_ptr() % 64 == 0
    large = torch.zeros(memory._HugePageArena.ARENA // 4, dtype=torch.uint8)
    assert memory.huge_page_copy(large).data_ptr() % HUGE_PAGE == 0  # a mapping of its own


def test_huge_page_copy_is_the_tensor_itself_where_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    monkeypatch.setattr(memory, "_ARENA", memory._HugePageArena())
    tensor = torch.ones(5)
    assert memory.huge_page_copy(tensor) is tensor
