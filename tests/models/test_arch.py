"""Every family in the architecture table: its paths exist; RTN, GPTQ, AWQ and SmoothQuant quantize it, the
smoothing folds and the rotation keep its float function, checkpoints round-trip and evaluation runs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import llmeasyquant as lq
from llmeasyquant.calibration.sequential import run_sequential
from llmeasyquant.methods import SmoothQuant
from llmeasyquant.methods.rotate import Rotate
from llmeasyquant.models.arch import ARCHITECTURES, arch_for, get_module, is_linear, query_columns
from llmeasyquant.models.experts import unfuse_experts

LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
CONFIGS = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE | {"head_dim": 16},
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                word_embed_proj_dim=64, max_position_embeddings=128),
    "gemma": LLAMA_LIKE | {"head_dim": 16},
    "gemma2": LLAMA_LIKE | {"head_dim": 16, "sliding_window": 16},  # one sliding-window layer, one global
    "gemma3_text": LLAMA_LIKE | {"head_dim": 16, "sliding_window": 16},
    "phi3": LLAMA_LIKE | {"pad_token_id": 0},
    "olmo": LLAMA_LIKE | {"pad_token_id": 0},
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=256, max_position_embeddings=128),  # parallel residual, a quarter of each head rotated
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256),  # 7B's layout
    # Mixtures of experts: 4 experts, 2 per token (tests/models/test_experts.py tests them further).
    "mixtral": LLAMA_LIKE | dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": LLAMA_LIKE | dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
                                   num_experts_per_tok=2),
    "qwen3_moe": LLAMA_LIKE | dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=16),
}
FAMILIES = sorted(CONFIGS)
IDS = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def tiny(model_type: str, **overrides) -> torch.nn.Module:
    """A tiny random model of the family whose norm weights and biases are random too (Gemma's start at 0, its
    1 + w at 1: a fold that forgot the offset would not show)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **(CONFIGS[model_type] | overrides))
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if "bias" in name else param.mean().item(), 0.2)
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def relative_error(found: torch.Tensor, reference: torch.Tensor) -> float:
    return float((found - reference).abs().max() / reference.abs().max())


def test_every_family_has_a_tiny_config():
    assert set(CONFIGS) == set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_table_paths_exist(model_type):
    model = unfuse_experts(tiny(model_type))  # a mixture of experts' per-expert paths exist once split
    arch = arch_for(model)
    blocks = get_module(model, arch.blocks)
    assert len(blocks) == 2
    for path in (*arch.embeddings, arch.final_norm, arch.lm_head):
        get_module(model, path)
    block = blocks[0]
    for name in filter(None, (arch.attention.q, arch.attention.k, arch.attention.v, arch.attention.o,
                              arch.attention.qkv)):
        assert is_linear(get_module(block, name)), name
    for source, targets in arch.smoothing:
        get_module(block, source)
        assert all(is_linear(get_module(block, t)) for t in targets)
    assert {source for source, _ in arch.unsmoothable} <= {source for source, _ in arch.smoothing}
    if arch.decoder is not None:
        spec = arch.decoder
        for path in (spec.attn_norm, spec.mlp_norm, spec.attention, spec.down, spec.activation,
                     *((spec.gate_up,) if spec.gate_up else (spec.gate, spec.up)), *(spec.qk_norm or ())):
            get_module(block, path)
    else:
        assert arch.decoder_missing, "say why the lean decoder does not cover it (its refusal quotes it)"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rtn_quantizes_every_block_linear_and_round_trips(model_type, tmp_path):
    model = tiny(model_type)
    arch = arch_for(model)
    with torch.no_grad():
        fused = model(torch.arange(24)[None]).logits
    unfuse_experts(model)  # what quantize() does first: the linears to expect are the split experts'
    with torch.no_grad():
        torch.testing.assert_close(model(torch.arange(24)[None]).logits, fused)
    linears = [n for n, m in model.named_modules() if is_linear(m) and n.startswith(arch.blocks + ".")
               and n[len(arch.blocks) + 1:].partition(".")[2] not in arch.float_layers]
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
    lq.quantize(model, lq.RTN(), lq.W8A16, progress=False)
    quantized = {n for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)}
    assert quantized == set(linears)
    with torch.no_grad():
        logits = model(ids).logits
    assert (logits - reference).abs().max() / reference.abs().max() < 0.05
    loaded, _ = lq.load(lq.save(model, tmp_path / model_type))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_unknown_family_is_a_clear_error():
    config = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=64, is_decoder=True)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(lq.ConfigError, match="not supported"):
        lq.quantize(model, lq.RTN(), lq.W8A16, progress=False)


@pytest.mark.parametrize("method", ["gptq", "awq", "smoothquant"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_calibrated_methods_quantize_every_family_and_round_trip(model_type, method, tmp_path):
    model = tiny(model_type)
    reference = logits(model)
    recipe, scheme = {"gptq": ([lq.GPTQ()], lq.W8A16), "awq": ([lq.AWQ(grid=5, clip_grid=5), lq.RTN()], lq.W8A16),
                      "smoothquant": ([SmoothQuant(0.5), lq.RTN()], lq.W8A8)}[method]
    lq.quantize(model, recipe, scheme, calib=CALIB, progress=False)
    assert {n for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)}
    found = logits(model)
    assert relative_error(found, reference) < 0.06  # 8-bit weights (and activations for SmoothQuant)
    loaded, _ = lq.load(lq.save(model, tmp_path / model_type))
    assert torch.equal(logits(loaded), found)


def _norm_sources(model: torch.nn.Module) -> set[str]:
    """The smoothing sources of the first block that are norms (not linears, which are targets too)."""
    arch = arch_for(model)
    block = get_module(model, arch.blocks)[0]
    return {source for source, _ in arch.smoothing if not is_linear(get_module(block, source))}


@pytest.mark.parametrize("method", ["smoothquant", "awq"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_smoothing_folds_keep_the_float_function(model_type, method, caplog):
    """The scales folded into each source (Gemma's 1 + w norms included) leave the logits as they were; sources the
    table calls unsmoothable are skipped with their reason logged."""
    model = unfuse_experts(tiny(model_type))  # run_sequential reads a mixture of experts' split linears
    arch = arch_for(model)
    block = get_module(model, arch.blocks)[0]
    before = {source: copy.deepcopy(get_module(block, source).state_dict()) for source in _norm_sources(model)}
    reference = logits(model)
    step = SmoothQuant(0.5) if method == "smoothquant" else lq.AWQ(grid=5, clip=False)
    plan = lq.Plan.uniform(lq.W8A8 if method == "smoothquant" else lq.W4A16_G64).resolve(model)
    with caplog.at_level(logging.INFO, logger="llmeasyquant.methods.smoothquant"):
        run_sequential(model, [step], plan, CALIB, progress=False)
    torch.testing.assert_close(logits(model), reference, rtol=1e-4, atol=1e-4)
    changed = {source for source, state in before.items()
               if any(not torch.equal(t, get_module(block, source).state_dict()[k]) for k, t in state.items())}
    if method == "smoothquant":  # AWQ's search may keep scales of 1 (plain rounding), which change nothing
        assert changed == _norm_sources(model) - {source for source, _ in arch.unsmoothable}
    for source, reason in arch.unsmoothable:
        assert f"no smoothing scales folded into {source} ({reason})" in caplog.text


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if ARCHITECTURES[f].rotation is not None])
def test_rotation_keeps_the_float_function(model_type):
    model = tiny(model_type)
    reference = logits(model)
    Rotate(seed=1).apply_model(model, arch_for(model))
    torch.testing.assert_close(logits(model), reference, rtol=2e-4, atol=2e-4)
    offset = arch_for(model).norm_offset
    block = get_module(model, arch_for(model).blocks)[0]
    for norm, _ in arch_for(model).rotation.readers:  # the norm's scale is folded away: offset + w = 1
        assert torch.allclose(get_module(block, norm).weight + offset, torch.ones(1))


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if ARCHITECTURES[f].rotation is None])
def test_families_without_rotation_refuse_it(model_type):
    with pytest.raises(lq.ConfigError, match=f"the {model_type} family cannot be rotated"):
        lq.quantize(tiny(model_type), [Rotate(), lq.RTN()], lq.W8A16, progress=False)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_evaluation_of_the_8bit_model_follows_the_float_model(model_type, tiny_tokenizer, wiki_text):
    reference = tiny(model_type)
    model = lq.quantize(copy.deepcopy(reference), lq.RTN(), lq.W8A16, progress=False)
    record = lq.evaluate(model, tiny_tokenizer, text=str(wiki_text), seqlen=32, max_windows=3, reference=reference,
                         progress=False)
    metrics = record.metrics
    assert metrics["windows"] == 3 and 1.0 < metrics["ppl"] < float("inf")
    assert metrics["kld"] < 1e-3 and metrics["top1"] > 0.9


def test_a_layout_the_entry_does_not_cover_is_refused():
    """Falcon-40B's layout (new_decoder_architecture: grouped q/k/v, two norms) is not the falcon entry's."""
    model = tiny("falcon", new_decoder_architecture=True, num_kv_heads=2)
    with pytest.raises(lq.ConfigError, match=r"new_decoder_architecture=True.*covers new_decoder_architecture=False"):
        lq.quantize(model, lq.RTN(), lq.W8A16, progress=False)


def test_query_columns_follow_the_fused_layout():
    """GPT-NeoX's query_key_value: head by head, that head's query, key and value (the attention splits it so)."""
    model = tiny("gpt_neox")
    arch = arch_for(model)
    attention = get_module(model, arch.blocks)[0].attention
    hidden = torch.randn(1, 5, 64)
    with torch.no_grad():
        fused = attention.query_key_value(hidden)
    queries = fused.view(1, 5, 4, 3 * 16).chunk(3, dim=-1)[0].reshape(1, 5, 64)  # as GPTNeoXAttention.forward
    assert torch.equal(fused[..., query_columns(arch.attention, 4, 16)], queries)
    assert query_columns(ARCHITECTURES["phi3"].attention, 4, 16) == slice(0, 64)
