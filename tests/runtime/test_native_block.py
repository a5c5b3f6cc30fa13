"""A decode step's block in one native call (runtime/native_block.py, native decode_block): the Python loop's bits."""

from __future__ import annotations

import pytest
import torch
from tests.runtime.test_decoder import family_model, prompt

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.kernels import native
from llmeasyquant.kernels.cpu import NativeInt4DigitsKernel, NativeInt8Int8Kernel, NativeInt8WeightOnlyKernel
from llmeasyquant.runtime.native_block import block_arguments

pytestmark = pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")


@pytest.fixture
def digits_kernel(monkeypatch):
    """The tests pick kernels in registry order, where W4A16 decode runs `cpu_native_w4a16`; the measured choice
    (bench, serve) takes the digits kernel, which the native block runs."""
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", NativeInt4DigitsKernel.name)


def quantized(family: str, scheme: str, fuse: bool = True) -> torch.nn.Module:
    model = lq.quantize(family_model(family), lq.RTN(), lq.parse_scheme(scheme), progress=False)
    if fuse:
        lq.fuse_shared_inputs(model)
    return model


def step_logits(decoder: LeanDecoder, native: bool, steps: list[int]) -> torch.Tensor:
    """Logits of the prompt and of each forced step, with the blocks on decode_block or all on the Python loop."""
    decoder.reset()
    decoder.native_blocks = native
    found = [decoder.prefill(prompt())]
    found += [decoder.step(torch.tensor(token)) for token in steps]
    return torch.stack(found)


# (scheme, kernel forced for every layer): each kind of decode_block
KINDS = [("w4a16-g32", NativeInt4DigitsKernel.name), ("w4a16-g32-asym", NativeInt4DigitsKernel.name),
         ("w4a16", NativeInt4DigitsKernel.name), ("w8a16", NativeInt8WeightOnlyKernel.name),
         ("w8a8", NativeInt8Int8Kernel.name)]


@pytest.mark.parametrize(("scheme", "kernel"), KINDS, ids=[scheme for scheme, _ in KINDS])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_one_call_a_block_gives_the_python_loops_bits(family, scheme, kernel, monkeypatch):
    # qwen2: biases on q, k, v; qwen3: a norm on each query and key head; phi3: q/k/v and gate/up fused as stored.
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", kernel)
    decoder = LeanDecoder(quantized(family, scheme), 32)
    native = step_logits(decoder, True, [9, 100, 42, 7])
    assert all(arguments is not None for arguments in decoder.step_blocks())
    assert torch.equal(native, step_logits(decoder, False, [9, 100, 42, 7]))
    assert torch.isfinite(native).all()


@pytest.mark.usefixtures("digits_kernel")
def test_blocks_that_do_not_qualify_step_on_the_python_loop():
    separate = LeanDecoder(quantized("llama", "w4a16-g32", fuse=False), 8)  # q, k, v as three GEMMs
    assert [block_arguments(block) for block in separate.blocks] == [None, None]
    assert block_arguments(LeanDecoder(family_model("llama"), 8).blocks[0]) is None  # fp32 linears


def test_other_kernels_and_layers_do_not_qualify(monkeypatch):
    # Registry order: W4A16 decode on `cpu_native_w4a16`, not the digits kernel.
    assert block_arguments(LeanDecoder(quantized("llama", "w4a16-g32"), 8).blocks[0]) is None
    # W8A16 with zero points: the native kernel's rank-1 term runs in Python.
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", NativeInt8WeightOnlyKernel.name)
    assert block_arguments(LeanDecoder(quantized("llama", "w8a16-asym"), 8).blocks[0]) is None
    # W8A8 whose activations are clipped before the kernel.
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", NativeInt8Int8Kernel.name)
    assert block_arguments(LeanDecoder(quantized("llama", "w8a8-ac90"), 8).blocks[0]) is None


@pytest.mark.usefixtures("digits_kernel")
def test_the_profiler_sees_each_operator_and_the_switch_turns_it_off():
    decoder = LeanDecoder(quantized("llama", "w4a16-g32"), 8)
    with torch.profiler.profile():
        assert decoder.step_blocks() is None
    assert decoder.step_blocks() is not None
    assert LeanDecoder(quantized("llama", "w4a16-g32"), 8, native_blocks=False).step_blocks() is None


def test_a_wrong_argument_list_is_refused():
    x = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="takes 20 tensors"):
        native.ops().decode_block(x, [None] * 3, [0] * 4, [32] * 4, [1e-5] * 4, 1e-8, x, x, x, x, 0, 1, 1.0)
