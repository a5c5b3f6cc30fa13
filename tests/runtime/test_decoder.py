"""The lean decode loop against transformers' own forward: logits, greedy tokens, chunked prefill, errors."""

from __future__ import annotations

import pytest
import torch
from tests.models.test_arch import tiny
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.errors import ConfigError

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256)
FAMILIES = {  # one tiny model per llama-like family, each with what sets it apart
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=False)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES)),  # biases on q, k, v
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)),  # RMSNorm on each query and key head
    # RMSNorms scaling by 1 + w, the embedding scaled by sqrt(hidden), GELU (the PyTorch-operator path)
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=16)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0)),  # fused qkv_proj and gate_up_proj
}


def family_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    for name, param in model.named_parameters():  # random norm weights and biases, so that a skipped one shows
        if param.dim() == 1:
            param.data.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def prompt(length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def transformers_logits(model: torch.nn.Module, ids: torch.Tensor, steps: list[int]) -> list[torch.Tensor]:
    """Next-token logits after the prompt and after each forced step, from the model's own forward and cache."""
    out = model(ids, use_cache=True)
    found, past = [out.logits[0, -1]], out.past_key_values
    for token in steps:
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        found.append(out.logits[0, -1])
        past = out.past_key_values
    return found


@torch.no_grad()
def lean_logits(model: torch.nn.Module, ids: torch.Tensor, steps: list[int]) -> list[torch.Tensor]:
    decoder = LeanDecoder(model, ids.shape[1] + len(steps))
    found = [decoder.prefill(ids)]
    found += [decoder.step(torch.tensor(token)) for token in steps]
    return found


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float_logits_match_transformers(family):
    model = family_model(family)
    steps = [5, 17, 250, 3]
    for ours, theirs in zip(lean_logits(model, prompt(), steps), transformers_logits(model, prompt(), steps),
                            strict=True):
        assert ours.shape == theirs.shape == (256,)
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w4a16-g32-asym"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "phi3"])
def test_quantized_logits_match_transformers(family, scheme, fuse):
    model = lq.quantize(family_model(family), lq.RTN(), lq.parse_scheme(scheme), progress=False)
    if fuse:  # q/k/v and gate/up in each of the two blocks (Phi-3's come fused)
        assert lq.fuse_shared_inputs(model) == (0 if family == "phi3" else 4)
    steps = [9, 100, 42]
    for ours, theirs in zip(lean_logits(model, prompt(), steps), transformers_logits(model, prompt(), steps),
                            strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers_generate():
    model = family_model("llama")
    ids = prompt(16, seed=3)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              pad_token_id=255)[0, 16:]
    decoder = LeanDecoder(model, 28)
    assert torch.equal(decoder.generate(ids, 12), expected)
    assert torch.equal(decoder.generate(ids, 12), expected)  # generate() starts over in the same cache
    with pytest.raises(ValueError, match="new_tokens"):
        decoder.generate(ids, 0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-operators", "pytorch-operators"])
def test_prefill_in_chunks_equals_one_prefill(fused):
    """A chunk after a cached prefix sees the prefix and the chunk's earlier positions only (the mask path)."""
    model = family_model("qwen2")
    ids = prompt(24)
    whole = LeanDecoder(model, 24, fused=fused).prefill(ids)
    chunked = LeanDecoder(model, 24, fused=fused)
    chunked.prefill(ids[:, :10])
    torch.testing.assert_close(chunked.prefill(ids[:, 10:]), whole, atol=2e-5, rtol=1e-4)


def test_cache_is_written_in_place_and_bounded():
    model = family_model("llama")
    decoder = LeanDecoder(model, 21)
    assert decoder.pool.num_blocks == 2  # 21 positions in blocks of 16: the pool holds this one sequence
    storage = decoder.pool.keys.untyped_storage().data_ptr()
    decoder.prefill(prompt())
    decoder.step(torch.tensor(1))
    assert decoder.length == 21 and decoder.pool.keys.untyped_storage().data_ptr() == storage
    with pytest.raises(ValueError, match="built for 21"):
        decoder.step(torch.tensor(1))


def test_the_decoder_runs_fp32_models_and_known_cache_types():
    with pytest.raises(ConfigError, match="load it in float32"):
        LeanDecoder(family_model("llama").to(torch.bfloat16), 8)
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        LeanDecoder(family_model("llama"), 8, kv_dtype="int3")


def test_unsupported_family_and_window(tiny_gpt2):
    with pytest.raises(ConfigError, match="gpt2 family"):
        LeanDecoder(tiny_gpt2, 16)
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=8)).eval()
    with pytest.raises(ConfigError, match="sliding window of 8"):
        LeanDecoder(windowed, 16)
    with pytest.raises(ValueError, match="max_tokens"):
        LeanDecoder(family_model("llama"), 0)


@pytest.mark.parametrize(("family", "missing"), [
    ("gemma2", "logit soft-capping"), ("gemma3_text", "norms on the attention's and the MLP's outputs"),
    ("olmo", "LayerNorm without parameters"), ("gpt_neox", "per-head q/k/v layout"),
    ("falcon", "parallel attention/MLP block")])
def test_families_it_does_not_cover_are_refused_saying_what_is_missing(family, missing):
    with pytest.raises(ConfigError, match=f"does not cover the {family} family .*{missing}"):
        LeanDecoder(tiny(family), 16)


def test_a_partial_rotary_embedding_is_refused():
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0, partial_rotary_factor=0.5)).eval()
    with pytest.raises(ConfigError, match="rotates 8 of its 16 channels per head"):
        LeanDecoder(model, 16)


def test_greedy_tokens_of_gemma_and_phi3_equal_transformers_generate():
    for family in ("gemma", "phi3"):
        model = family_model(family)
        ids = prompt(16, seed=3)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                  pad_token_id=255)[0, 16:]
        assert torch.equal(LeanDecoder(model, 28).generate(ids, 12), expected), family


def test_a_batch_of_prompts_is_refused_not_joined():
    model = family_model("llama")
    with pytest.raises(ValueError, match="one sequence"):
        LeanDecoder(model, 64).generate(torch.randint(0, 256, (2, 8)), 4)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w4a16-g32-learned", "w3a16-g32-learned"])
def test_grid_layers_run_in_the_lean_decoder_as_in_transformers(scheme, fuse):
    """Grid layers run through QuantLinear's kernels (the table-lookup W4A16 one) in the lean loop; fused groups
    carry a learned grid's per-row tables as they carry the scales."""
    model = lq.quantize(family_model("llama"), lq.RTN(), lq.parse_scheme(scheme), progress=False)
    if fuse:
        assert lq.fuse_shared_inputs(model) == 4
    steps = [9, 100, 42]
    for ours, theirs in zip(lean_logits(model, prompt(), steps), transformers_logits(model, prompt(), steps),
                            strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
