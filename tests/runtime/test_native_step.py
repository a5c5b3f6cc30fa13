"""The engine's step in one native call (runtime/native_step.py, native_step.cpp): the Python forward's bits, for
every step kind, family and pool, at one row, a prompt chunk, and rows of several sequences."""

from __future__ import annotations

import pytest
import torch
from tests.runtime.test_decoder import family_model, prompt

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.kernels import native
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
from llmeasyquant.kernels.reference import ReferenceKernel
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.runtime.batch import BatchDecoder
from llmeasyquant.runtime.kv_pool import FloatPool, QuantPool, Shape
from llmeasyquant.runtime.model_parts import DecoderParts

pytestmark = pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")

STEPS = [9, 100, 42, 7]
# (scheme, kernel forced on every layer): together they run every kind of step_kinds.h, at one row (decode), a
# bucket of 16 rows (an 8-token prompt) and of 128 (a 20-token prompt); the digits kernel reads weight tiles where
# they hold the groups (g32, g64, per channel) and the stored codes elsewhere (g16)
KERNELS = [
    ("w4a16-g32", NativeInt4DigitsKernel.name), ("w4a16-g32-asym", NativeInt4DigitsKernel.name),
    ("w4a16", NativeInt4DigitsKernel.name), ("w4a16-g64-asym", NativeInt4DigitsKernel.name),
    ("w4a16-g16", NativeInt4DigitsKernel.name), ("w4a16-g32-asym", NativeInt4WeightOnlyKernel.name),
    ("w4a16-g32", Int4WeightOnlyKernel.name), ("w4a16", Int4WeightOnlyKernel.name),
    ("w8a16", NativeInt8WeightOnlyKernel.name), ("w8a16-asym", NativeInt8WeightOnlyKernel.name),
    ("w8a16", Int8WeightOnlyKernel.name), ("w8a16-asym", Int8WeightOnlyKernel.name),
    ("w8a8", NativeInt8Int8Kernel.name), ("w8a8", Int8DynamicActKernel.name), ("w8a8", FloatInt8Int8Kernel.name),
    ("w4a8-g32", NativeInt4Int8Kernel.name), ("w4a8-g32-aasym", NativeInt4Int8Kernel.name),
    ("w4a4-g32-aasym-ag32", NativeInt4Int8Kernel.name),
    ("w8a16-asym", ReferenceKernel.name), ("w4a16-g32-asym", ReferenceKernel.name),
    ("w4a16-g32-asym", Bf16DequantInt4Kernel.name), ("w4a16", Bf16DequantInt4Kernel.name),
    # offered only where the build has AVX-512 BF16's dot products
    *([("w4a16-g32", Bf16TilesInt4Kernel.name), ("w4a16-g64-asym", Bf16TilesInt4Kernel.name),
       ("w4a16", Bf16TilesInt4Kernel.name)] if native.ops() is not None and native.ops().bf16_dot_built() else []),
]


def quantized(family: str, scheme: str, fuse: bool = True) -> torch.nn.Module:
    model = lq.quantize(family_model(family), lq.RTN(), lq.parse_scheme(scheme), progress=False)
    if fuse:
        lq.fuse_shared_inputs(model)
    return model


def logits_both_ways(model: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor, LeanDecoder]:
    """Logits of a prompt of `length` tokens and of each forced step, on the native step and on the Python
    forward (the same model and kernels)."""
    found = []
    for native_blocks in (True, False):
        decoder = LeanDecoder(model, length + len(STEPS), native_blocks=native_blocks)
        logits = [decoder.prefill(prompt(length))] + [decoder.step(torch.tensor(token)) for token in STEPS]
        found.append(torch.stack(logits))
        if native_blocks:
            native_decoder = decoder
    return found[0], found[1], native_decoder


def kinds_used(decoder: LeanDecoder, rows: int) -> set[str]:
    names = {number: name for name, number in native.ops().STEP_KINDS.items()}
    step = decoder.batch.native_step(rows)
    assert step.native_blocks == len(decoder.blocks)  # every block in the native call
    from llmeasyquant.runtime.native_step import linear_arguments

    return {names[linear_arguments(member, rows, native.ops().STEP_KINDS)[0]]
            for block in decoder.blocks for projection in block.projections for member in projection.members}


@pytest.mark.parametrize(("scheme", "kernel"), KERNELS, ids=[f"{s}-{k}" for s, k in KERNELS])
def test_every_kind_gives_the_python_forwards_bits(scheme, kernel, monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", kernel)
    model = quantized("llama", scheme)
    for length in (8, 20):  # a prompt in the 16-row bucket (decode kernels) and in the 128-row one
        native_logits, python_logits, decoder = logits_both_ways(model, length)
        assert torch.equal(native_logits, python_logits), (scheme, kernel, length)
        assert torch.isfinite(native_logits).all()
        kinds_used(decoder, length)
        kinds_used(decoder, 1)


def test_the_kernels_cover_every_step_kind(monkeypatch):
    covered = set()
    for scheme, kernel in KERNELS:
        monkeypatch.setenv("LLMEASYQUANT_KERNEL", kernel)
        decoder = LeanDecoder(quantized("llama", scheme), 24)
        decoder.prefill(prompt(20))
        decoder.step(torch.tensor(3))
        covered |= kinds_used(decoder, 1) | kinds_used(decoder, 20)
    decoder = LeanDecoder(family_model("llama"), 8)  # fp32 linears, q/k/v and gate/up as separate GEMMs
    decoder.prefill(prompt(4))
    covered |= kinds_used(decoder, 4)
    offered = set(native.ops().STEP_KINDS) - ({"int4_bf16_tiles"} if not native.ops().bf16_dot_built() else set())
    assert covered == offered


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
@pytest.mark.parametrize("scheme", ["fp32", "w8a8", "w4a16-g32-asym"])
def test_every_family_gives_the_python_forwards_bits(family, scheme, monkeypatch):
    # qwen2: biases on q, k, v; qwen3: a norm on each query and key head; phi3: q/k/v and gate/up fused as stored.
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "first")
    model = family_model(family) if scheme == "fp32" else quantized(family, scheme)
    native_logits, python_logits, decoder = logits_both_ways(model, 20)
    assert torch.equal(native_logits, python_logits)
    assert decoder.batch.native_step(1).native_blocks == len(decoder.blocks)


def rows_of_two_sequences(pool, steps: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(ids, slots, positions) of steps mixing a prompt chunk of one sequence with decode rows of another."""
    first, second = pool.allocate(40), pool.allocate(40)
    ids = prompt(40, seed=1)[0].tolist()
    plan = [(ids[:12], [first] * 12, list(range(12)))]
    for step in range(steps):
        chunk = list(range(12 + 4 * step, 16 + 4 * step))
        plan.append(([*[ids[p] for p in chunk], ids[step]], [first] * 4 + [second], [*chunk, step]))
    return plan


@pytest.mark.parametrize("kv", ["float16", "float32", 4, 3])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16-g32"])
def test_rows_of_several_sequences_on_every_pool(kv, scheme, monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "first")
    model = quantized("qwen3", scheme)
    found = []
    for native_blocks in (True, False):
        parts = DecoderParts(model, 64)
        shape = Shape(len(parts.blocks), parts.kv_heads, parts.head_dim, parts.heads)
        pool = (FloatPool(shape, 1 << 22, 2, 64, kv) if isinstance(kv, str) else
                QuantPool(shape, 1 << 22, 2, 64, KVQuantConfig(key_bits=kv, value_bits=kv), parts.cos, parts.sin))
        decoder = BatchDecoder(parts, pool, native=native_blocks)
        logits = []
        for ids, slots, positions in rows_of_two_sequences(pool, 5):
            rows = pool.rows(slots, positions)
            logits.append(decoder.forward(torch.tensor(ids), rows, torch.arange(len(ids))))
        found.append(torch.cat(logits))
        step = decoder.native_step(5)
        assert (step.native_blocks if native_blocks else step) == (len(parts.blocks) if native_blocks else None)
    assert torch.equal(found[0], found[1])


def test_blocks_that_do_not_qualify_step_on_the_python_forward(monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "first")
    clipped = quantized("llama", "w8a8-ac90")  # activations clipped before the kernel
    native_logits, python_logits, decoder = logits_both_ways(clipped, 8)
    assert decoder.batch.native_step(1).native_blocks == 0
    assert torch.equal(native_logits, python_logits)
    grid = LeanDecoder(quantized("llama", "w4a16-g32-nf4"), 8)  # a grid's tables: no step kind
    assert grid.batch.native_step(1).native_blocks == 0


def test_the_profiler_sees_each_operator_and_the_switch_turns_it_off():
    decoder = LeanDecoder(quantized("llama", "w8a8"), 8)
    with torch.profiler.profile():
        assert decoder.batch.native_step(1) is None
    assert decoder.batch.native_step(1) is not None
    assert LeanDecoder(quantized("llama", "w8a8"), 8, native_blocks=False).batch.native_step(1) is None


def test_a_wrong_argument_list_is_refused():
    ops = native.ops()
    tables = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="unknown gate activation"):
        ops.StepProgram(2, 1.0, False, tables, torch.empty(0), torch.empty(0), 0, 0, 1e-8, 7)
    program = ops.StepProgram(2, 1.0, False, tables, torch.empty(0), torch.empty(0), 0, 0, 1e-8,
                              ops.GATE_ACTIVATIONS["silu"])
    with pytest.raises(RuntimeError, match="add a block before"):
        program.add_linear(0, 0, [torch.zeros(2, 2)] + [None] * 4, [0] * 7)
    with pytest.raises(RuntimeError, match="4 norms"):
        program.add_block([torch.ones(2)], [1e-5], [torch.zeros(1), torch.zeros(1)])
    program.add_block([torch.ones(2), torch.ones(2), None, None], [1e-5] * 4, [torch.zeros(1), torch.zeros(1)])
    with pytest.raises(RuntimeError, match="unknown step kind"):
        program.add_linear(0, 99, [torch.zeros(2, 2)] + [None] * 4, [0] * 7)
    with pytest.raises(RuntimeError, match="not within"):
        program.run(torch.zeros(1, 2), *[torch.zeros(1)] * 6, 0, 2)
