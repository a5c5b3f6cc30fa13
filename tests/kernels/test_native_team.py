"""The native step's team (kernels/native/native_step.cpp): a decode step's blocks in one OpenMP parallel region give
the per-operator path's logits bit for bit, for every linear kind with a step form and every pool, at 1 and 2
threads; steps it does not cover run operator by operator."""

from __future__ import annotations

import pytest
import torch
from tests.runtime.test_decoder import family_model
from transformers import LlamaConfig, LlamaForCausalLM

import llmeasyquant as lq
from llmeasyquant.kernels import choice, native
from llmeasyquant.kernels.cpu import (
    NativeInt4DigitsKernel,
    NativeInt4Int8Kernel,
    NativeInt8Int8Kernel,
    NativeInt8WeightOnlyKernel,
)
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.runtime.batch import BatchDecoder
from llmeasyquant.runtime.kv_pool import FloatPool, QuantPool, Shape
from llmeasyquant.runtime.model_parts import DecoderParts

pytestmark = pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")

CONTEXT = 96
PROMPTS = [5, 37, 20]  # one sequence per length: rows of different lengths, past a KV block


def wide_llama(hidden: int = 128, heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    """A llama whose widths are multiples of 64 (W4A16 at g64), with random norm weights as family_model's."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=256,
                         max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    for param in model.parameters():
        if param.dim() == 1:
            param.data.normal_(1.0, 0.2)
    return model


# (scheme, kernel forced for every layer, model): each step kind the team runs, with biases (qwen2), q/k norms
# (qwen3) and widths that are not multiples of 64 (the tiny families: 64 x 96) among them
CASES = [("w8a8", NativeInt8Int8Kernel.name, "llama"), ("w8a8", NativeInt8Int8Kernel.name, "qwen2"),
         ("w8a16", NativeInt8WeightOnlyKernel.name, "qwen3"), ("w8a16", NativeInt8WeightOnlyKernel.name, "wide"),
         ("w4a16-g32", NativeInt4DigitsKernel.name, "qwen2"), ("w4a16-g32-asym", NativeInt4DigitsKernel.name, "llama"),
         ("w4a16-g64", NativeInt4DigitsKernel.name, "wide"), ("w4a16-g64-asym", NativeInt4DigitsKernel.name, "wide"),
         ("w4a8", NativeInt4Int8Kernel.name, "llama"), ("w4a8-g32", NativeInt4Int8Kernel.name, "qwen2"),
         ("w4a8-ag32-g32", NativeInt4Int8Kernel.name, "qwen3"), ("w4a4-ag32-g32", NativeInt4Int8Kernel.name, "wide")]
POOLS = ["float32", "float16", "simquant4"]


def quantized(scheme: str, family: str) -> torch.nn.Module:
    # long: 1 kv head of 128 values for 4 query heads, so that a decode row over some thousand positions has work
    # enough for attention's plan to split it over the threads and merge the pieces
    model = {"wide": wide_llama, "long": lambda: wide_llama(512, 4, 1)}.get(family, lambda: family_model(family))()
    model = lq.quantize(model, lq.RTN(), lq.parse_scheme(scheme), progress=False)
    lq.fuse_shared_inputs(model)
    return model


def make_pool(parts: DecoderParts, kind: str, sequences: int = len(PROMPTS), context: int = CONTEXT):
    shape = Shape(len(parts.blocks), parts.kv_heads, parts.head_dim, parts.heads)
    budget = 16 * 2**20
    if kind == "simquant4":
        return QuantPool(shape, budget, sequences, context, KVQuantConfig(key_bits=4, value_bits=4), parts.cos,
                         parts.sin)
    return FloatPool(shape, budget, sequences, context, kind)


def serve(model: torch.nn.Module, pool_kind: str, team: bool, monkeypatch, prompts: list[int] = PROMPTS,
          context: int = CONTEXT) -> tuple[list[torch.Tensor], list[bool]]:
    """The logits of each prompt and of decode steps of every sequence together, then of one alone, then of the
    others, with the team on or off (LLMEASYQUANT_STEP_TEAM, read when a program is built); and whether the team
    covered each decode step."""
    monkeypatch.setenv("LLMEASYQUANT_STEP_TEAM", "1" if team else "0")
    parts = DecoderParts(model, context)
    pool = make_pool(parts, pool_kind, len(prompts), context)
    decoder = BatchDecoder(parts, pool)
    slots = [pool.allocate(context) for _ in prompts]
    lengths = list(prompts)
    found = []
    for slot, length in zip(slots, lengths, strict=True):
        ids = torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(length))
        found.append(decoder.forward(ids, pool.rows([slot] * length, range(length)), torch.tensor([length - 1])))
    covered = []
    everyone = list(range(len(prompts)))
    for step in range(5):
        active = everyone if step < 3 else [1] if step == 3 else everyone[:1] + everyone[2:]
        ids = torch.tensor([(7 * step + 11 * s) % 250 + 3 for s in active])
        rows = pool.rows([slots[s] for s in active], [lengths[s] for s in active])
        found.append(decoder.forward(ids, rows, torch.arange(len(active))))
        program = decoder.native_step(len(active)).program
        covered.append(program.team_covers(len(active), 0, program.blocks()))
        for s in active:
            lengths[s] += 1
    return found, covered


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("pool_kind", POOLS)
@pytest.mark.parametrize(("scheme", "kernel", "family"), CASES, ids=[f"{s}-{f}" for s, _, f in CASES])
def test_the_team_gives_the_per_op_paths_bits(scheme, kernel, family, pool_kind, threads, monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", kernel)
    model = quantized(scheme, family)
    together, covered = serve(model, pool_kind, True, monkeypatch)
    one_by_one, not_covered = serve(model, pool_kind, False, monkeypatch)
    assert all(covered) and not any(not_covered)
    for a, b in zip(together, one_by_one, strict=True):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


@pytest.mark.parametrize("pool_kind", ["float16", "simquant4"])
@pytest.mark.parametrize(("scheme", "kernel"), [("w8a8", NativeInt8Int8Kernel.name),
                                                 ("w4a16-g32", NativeInt4DigitsKernel.name)])
def test_long_rows_split_attention_over_the_team_with_the_per_op_bits(scheme, kernel, pool_kind, threads,
                                                                       monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", kernel)
    model = quantized(scheme, "long")
    prompts = [1500, 1000, 40]
    together, covered = serve(model, pool_kind, True, monkeypatch, prompts, 1600)
    one_by_one, _ = serve(model, pool_kind, False, monkeypatch, prompts, 1600)
    assert all(covered)
    for a, b in zip(together, one_by_one, strict=True):
        assert torch.equal(a, b)


def test_steps_the_team_does_not_cover_run_operator_by_operator(monkeypatch):
    # A linear kind without a step form (the registry's first W4A16 decode kernel, on bf16 dot products), prompt
    # chunks past 16 rows, and an unquantized model (fp32 nn.Linear): the per-op path.
    model = quantized("w4a16-g32", "llama")
    parts = DecoderParts(model, CONTEXT)
    decoder = BatchDecoder(parts, make_pool(parts, "float32"))
    program = decoder.native_step(1).program
    assert not program.team_covers(1, 0, program.blocks())
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", NativeInt4DigitsKernel.name)
    model = quantized("w4a16-g32", "llama")
    parts = DecoderParts(model, CONTEXT)
    decoder = BatchDecoder(parts, make_pool(parts, "float32"))
    program = decoder.native_step(1).program
    assert program.team_covers(1, 0, program.blocks()) and program.team_covers(16, 0, program.blocks())
    assert not program.team_covers(17, 0, program.blocks())
    program.set_team(False)
    assert not program.team_covers(1, 0, program.blocks())
    parts = DecoderParts(family_model("llama"), CONTEXT)
    program = BatchDecoder(parts, make_pool(parts, "float32")).native_step(1).program
    assert not program.team_covers(1, 0, program.blocks())


@pytest.mark.parametrize(("scheme", "kernel"), [("w8a16-asym", NativeInt8WeightOnlyKernel.name),
                                                 ("w4a8-aasym", NativeInt4Int8Kernel.name)])
def test_zero_point_terms_on_pytorch_operators_keep_a_linear_off_the_team(scheme, kernel, monkeypatch):
    # W8A16's asymmetric weights and W4A8's asymmetric activations take a rank-1 correction of PyTorch operators
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", kernel)
    model = quantized(scheme, "llama")
    parts = DecoderParts(model, CONTEXT)
    program = BatchDecoder(parts, make_pool(parts, "float32")).native_step(1).program
    assert not program.team_covers(1, 0, program.blocks())


@pytest.mark.parametrize(("scheme", "fastest_alone", "team_kernel"), [
    ("w8a8", "cpu_int_mm_w8a8", "cpu_native_w8a8"),
    ("w4a16-g32", "cpu_int4pack_w4a16", "cpu_native_w4a16_i16"),
])
def test_the_choice_keeps_decode_rows_in_the_team(scheme, fastest_alone, team_kernel, monkeypatch):
    """A kernel without a team form that wins a layer's timing alone would take a one-row step out of the team:
    at one row only kernels with one are timed; at more rows (16, 128), every kernel."""
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "measured")
    monkeypatch.setattr(choice, "_seconds", lambda layer, kernel, x: 1.0 if kernel.name == fastest_alone else 2.0)
    choice.forget_choices()
    try:
        weight = torch.randn(192, 576, generator=torch.Generator().manual_seed(0)) * 0.05
        layer = lq.QuantLinear.from_weight(weight, None, lq.parse_scheme(scheme))
        ops = native.ops()
        assert layer.kernel(1).name == team_kernel
        assert layer.kernel(16).name == layer.kernel(128).name == fastest_alone
        call = layer.kernel(1).step_call(layer, layer.prepared_for(layer.kernel(1)), 1)
        assert ops.has_team_form(*call.arguments(layer, ops.STEP_KINDS))
    finally:
        choice.forget_choices()
