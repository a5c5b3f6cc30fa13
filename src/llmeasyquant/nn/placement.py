"""A loaded model's weights moved onto 2 MiB pages before decoding.

A decode step streams every weight once from memory. On 4 KiB pages that is a TLB miss and a page walk every 4 KiB
of each stream; on transparent huge pages, one every 2 MiB (llama.cpp's mapped GGUF file is on them). Moving the
weights made the 8B W4A16 checkpoint decode 1.028x as fast on the reference machine and the 1B one 1.046x, in one
process (benchmarks/huge_pages.py; docs/RESULTS.md, "Weights on 2 MiB pages"). Values, shapes, strides and the
sharing of fused layers' views are kept, so every result is the same bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from llmeasyquant.infra.memory import huge_page_buffer, release_freed_memory
from llmeasyquant.nn.qlinear import QuantLinear

log = logging.getLogger(__name__)

_ALIGNMENT = 64  # bytes: each storage starts on a cache line (the int8pack operator needs 16)


def _weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer, with the joined buffers of fused groups (held by the group, not a submodule)."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from (b for b in module.buffers(recurse=False) if b is not None)
        if isinstance(module, QuantLinear) and module.shared is not None:
            yield from module.shared[0].combined.buffers(recurse=False)


def place_on_huge_pages(model: nn.Module) -> int:
    """Move the model's CPU weights into one mapping on transparent huge pages; returns the bytes moved (0 where
    huge pages are not available). Every tensor keeps its identity (its `.data` is rebound), so modules and caches
    that hold it follow; what kernels prepared from the old memory is dropped and made again on the next call."""
    tensors = list({id(t): t for t in _weights(model) if t.device.type == "cpu" and t.numel() > 0}.values())
    by_storage: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    sizes = {key: group[0].untyped_storage().nbytes() for key, group in by_storage.items()}
    total = sum(-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes.values())
    arena = huge_page_buffer(total)
    if arena is None:
        return 0
    offset = 0
    for key, group in by_storage.items():  # one storage at a time: the old one is freed before the next is copied
        size = sizes[key]
        region = arena[offset:offset + size]
        region.copy_(torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage()))
        for tensor in group:  # as_strided counts its offset from the mapping's start, as the typed region does
            typed = region.view(tensor.dtype)
            start = typed.storage_offset() + tensor.storage_offset()
            tensor.data = typed.as_strided(tensor.shape, tensor.stride(), start)
        offset += -(-size // _ALIGNMENT) * _ALIGNMENT
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.forget_kernel()
    release_freed_memory()
    log.info("moved %.2f GB of weights onto 2 MiB pages", total / 1e9)
    return total
