"""Every family in the architecture table: its paths exist, RTN quantizes every block linear, checkpoints round-trip."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import llmeasyquant as lq
from llmeasyquant.models.arch import ARCHITECTURES, arch_for, get_module, is_linear
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
    # Mixtures of experts: 4 experts, 2 per token (tests/models/test_experts.py tests them further).
    "mixtral": LLAMA_LIKE | dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": LLAMA_LIKE | dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
                                   num_experts_per_tok=2),
    "qwen3_moe": LLAMA_LIKE | dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=16),
}


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    return AutoModelForCausalLM.from_config(config).eval()


def test_every_family_has_a_tiny_config():
    assert set(CONFIGS) == set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
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


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
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
