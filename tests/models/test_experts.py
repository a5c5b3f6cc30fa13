"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): fused experts split into per-expert linears, every method
quantizing every expert, the router kept float, token counts per expert, the fallback of an expert no token
reached, checkpoints, and the exports and runtimes that refuse them."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import llmeasyquant as lq
from llmeasyquant.calibration.sequential import capture_block_inputs
from llmeasyquant.methods.base import BlockContext
from llmeasyquant.models.arch import arch_for, get_module
from llmeasyquant.models.experts import ExpertMLP, RoutedExperts, expert_tokens, unfuse_experts
from llmeasyquant.scheme import parse_scheme

EXPERTS, TOP_K, LAYERS = 4, 2, 2
BASE = dict(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128, num_experts_per_tok=TOP_K)
CONFIGS = {
    "mixtral": BASE | dict(intermediate_size=64, num_local_experts=EXPERTS),
    "qwen2_moe": BASE | dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=EXPERTS),
    "qwen3_moe": BASE | dict(moe_intermediate_size=64, num_experts=EXPERTS, head_dim=16),
}
METHODS = {
    "rtn": lambda: ([lq.RTN()], lq.W8A16),
    "gptq": lambda: ([lq.GPTQ()], lq.W8A16),
    "awq": lambda: ([lq.AWQ(grid=5, clip_grid=5), lq.RTN()], lq.W8A16),
    "smoothquant": lambda: ([lq.SmoothQuant(), lq.RTN()], lq.W8A8),
}
UNSEEN = 3  # the expert the biased router never picks


def tiny(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIGS[model_type])).eval()


def calib() -> torch.Tensor:
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(ids()).logits


def expert_linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules()
            if ".experts." in name and name.endswith(("gate_proj", "up_proj", "down_proj"))}


def avoid_expert(model: nn.Module, expert: int) -> nn.Module:
    """Route every token away from `expert`: the router's logits for it set to -inf, the top-k taken again."""
    def hook(module: nn.Module, _args: tuple, output: tuple) -> tuple:
        router_logits = output[0].clone()
        router_logits[:, expert] = float("-inf")
        top, index = router_logits.float().softmax(-1).topk(module.top_k, dim=-1)
        return output[0], (top / top.sum(-1, keepdim=True)).to(output[1].dtype), index

    for block in get_module(model, arch_for(model).blocks):
        block.mlp.gate.register_forward_hook(hook)
    return model


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_split_experts_compute_what_the_fused_ones_do(model_type):
    model = tiny(model_type)
    fused = logits(model)
    unfuse_experts(model)
    for block in get_module(model, arch_for(model).blocks):
        assert isinstance(block.mlp.experts, RoutedExperts) and len(block.mlp.experts) == EXPERTS
        assert all(isinstance(e, ExpertMLP) and type(e.gate_proj) is nn.Linear for e in block.mlp.experts)
    split = logits(model)
    torch.testing.assert_close(split, fused, rtol=1e-5, atol=1e-5)  # the same sums, in float rounding
    assert torch.equal(logits(unfuse_experts(model)), split)  # splitting again changes nothing


def test_a_dense_family_is_left_as_it_is():
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    before = [name for name, _ in model.named_modules()]
    assert [name for name, _ in unfuse_experts(model).named_modules()] == before


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_method_quantizes_every_expert_and_counts_its_tokens(model_type, method):
    model = tiny(model_type)
    reference = logits(model)
    recipe, scheme = METHODS[method]()
    data = calib()
    lq.quantize(model, recipe, scheme, calib=data, progress=False)
    out = logits(model)
    assert (out - reference).abs().max() / reference.abs().max() < 0.05
    linears = expert_linears(model)
    assert len(linears) == LAYERS * EXPERTS * 3 and all(isinstance(m, lq.QuantLinear) for m in linears.values())
    arch = arch_for(model)
    blocks = get_module(model, arch.blocks)
    for name in arch.float_layers:  # the router (and Qwen2-MoE's shared-expert gate) stays float
        assert all(not isinstance(get_module(b, name), lq.QuantLinear) for b in blocks)
        assert all(get_module(b, name).weight.is_floating_point() for b in blocks)
    tokens = model.llmeasyquant.calibration["tokens"]
    for index, report in enumerate(model.llmeasyquant.blocks):
        per_expert = expert_tokens(report.tokens, arch.experts, EXPERTS)
        assert sum(per_expert) == data.numel() * TOP_K  # each token went to top-k experts
        assert per_expert == [tokens[f"{arch.blocks}.{index}.mlp.experts.{e}.gate_proj"] for e in range(EXPERTS)]
    assert "fallbacks" not in model.llmeasyquant.calibration  # every expert read enough tokens here


FALLBACKS = {
    "gptq": (lambda: [lq.GPTQ()], ["gptq: 0 calibration tokens (fewer than 16), rounded to nearest (RTN)"]),
    "awq": (lambda: [lq.AWQ(grid=5, clip_grid=5), lq.RTN()],
            ["awq: 0 calibration tokens (fewer than 16), no clipping"]),
    "smoothquant": (lambda: [lq.SmoothQuant(), lq.RTN()], None),
}


@pytest.mark.parametrize("method", sorted(FALLBACKS))
def test_an_expert_no_token_reached_falls_back_and_the_checkpoint_says_so(method, tmp_path, caplog):
    model = avoid_expert(tiny("mixtral"), UNSEEN)
    reference = logits(model)
    recipe, gate_notes = FALLBACKS[method]
    with caplog.at_level(logging.WARNING):
        lq.quantize(model, recipe(), lq.W8A16 if method != "smoothquant" else lq.W8A8, calib=calib(),
                    progress=False)
    assert (logits(model) - reference).abs().max() / reference.abs().max() < 0.05
    assert all(isinstance(m, lq.QuantLinear) for m in expert_linears(model).values())  # the unseen one too
    calibration = model.llmeasyquant.calibration
    fallbacks = calibration["fallbacks"]
    for layer in range(LAYERS):
        unseen = f"model.layers.{layer}.mlp.experts.{UNSEEN}"
        assert calibration["tokens"][f"{unseen}.gate_proj"] == 0
        assert calibration["tokens"][f"{unseen}.down_proj"] == 0
        if gate_notes is not None:
            assert fallbacks[f"{unseen}.gate_proj"] == gate_notes
        # SmoothQuant and AWQ smooth each expert's up -> down pair: not the unseen expert's.
        assert any(f"{method}: 0 calibration tokens" in note for note in fallbacks[f"{unseen}.down_proj"])
        assert f"{unseen}.gate_proj" in caplog.text or method == "smoothquant"
    assert all(f".experts.{UNSEEN}." in name for name in fallbacks)  # the other experts read enough
    folder = lq.save(model, tmp_path / "moe")
    assert json.loads((folder / "quantization_config.json").read_text())["calibration"] == calibration
    loaded, _ = lq.load(folder)
    assert loaded.llmeasyquant.calibration == calibration
    assert torch.equal(logits(avoid_expert(loaded, UNSEEN)), logits(model))


def test_fewer_tokens_than_min_tokens_fall_back_too():
    model = tiny("qwen3_moe")
    lq.quantize(model, lq.GPTQ(min_tokens=10_000), lq.W8A16, calib=calib(), progress=False)
    fallbacks = model.llmeasyquant.calibration["fallbacks"]
    assert set(fallbacks) == {n for n in expert_linears(model)} | {
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkvo"}
    assert all("rounded to nearest (RTN)" in notes[0] for notes in fallbacks.values())


def test_static_activation_scales_of_an_unseen_expert_take_its_peers_range():
    model = avoid_expert(tiny("mixtral"), UNSEEN)
    lq.quantize(model, lq.RTN(), parse_scheme("w8a8-astatic"), calib=calib(), progress=False)
    fallbacks = model.llmeasyquant.calibration["fallbacks"]
    unseen = f"model.layers.0.mlp.experts.{UNSEEN}"
    assert fallbacks[f"{unseen}.up_proj"] == ["static input range: no calibration token, took the range of the "
                                               "other experts' same layer"]
    blocks = get_module(model, "model.layers")
    peers = [blocks[0].mlp.experts[e].up_proj.input_scale for e in range(EXPERTS) if e != UNSEEN]
    assert torch.equal(blocks[0].mlp.experts[UNSEEN].up_proj.input_scale, torch.stack(peers).amax(0))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_round_trip_gives_the_same_logits(model_type, tmp_path):
    model = tiny(model_type)
    lq.quantize(model, lq.GPTQ(), lq.W4A16_G64, calib=calib(), progress=False)
    loaded, _ = lq.load(lq.save(model, tmp_path / model_type))
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize("fmt", ["gguf", "compressed-tensors", "onnx"])
def test_exports_refuse_a_mixture_of_experts(fmt, tmp_path):
    model = lq.quantize(tiny("qwen2_moe"), lq.RTN(), lq.W8A16, progress=False)
    with pytest.raises(lq.ConfigError, match="qwen2_moe"):
        lq.export(model, fmt, tmp_path / ("out.gguf" if fmt == "gguf" else "out"))


def test_lean_decoder_rotation_and_search_refuse_a_mixture_of_experts():
    model = lq.quantize(tiny("mixtral"), lq.RTN(), lq.W8A16, progress=False)
    with pytest.raises(lq.ConfigError, match="lean decode loop does not cover the mixtral family"):
        lq.LeanDecoder(model, 16)
    with pytest.raises(lq.ConfigError, match="mixtral family cannot be rotated"):
        lq.quantize(tiny("mixtral"), [lq.Rotate(), lq.RTN()], lq.W8A16, progress=False)
    with pytest.raises(lq.ConfigError, match="search does not cover the mixture of experts of mixtral"):
        lq.MixedPrecisionSearch(sensitivity="entropy", method="rtn").measure(tiny("mixtral"), None)


@pytest.mark.parametrize("method", [lq.SmoothQuant(alpha=0.8), lq.AWQ(grid=5, clip=False)], ids=["smoothquant", "awq"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_smoothing_the_norm_every_expert_reads_keeps_the_routing(model_type, method):
    model = unfuse_experts(tiny(model_type))
    reference = logits(model)
    arch = arch_for(model)
    block = get_module(model, arch.blocks)[0]
    routers = {name: get_module(block, name).weight.detach().clone() for name in arch.float_layers}
    plan = {name: lq.W8A8 for name, module in block.named_modules()
            if type(module) is nn.Linear and name not in arch.float_layers}
    inputs, kwargs = capture_block_inputs(model, calib())
    method.apply(block, BlockContext(index=0, prefix="model.layers.0.", plan=plan, arch=arch, inputs=inputs,
                                     kwargs=kwargs))
    norm_scale = get_module(block, "post_attention_layernorm").weight
    assert not torch.allclose(norm_scale, torch.ones_like(norm_scale))  # a scale was folded into the norm
    for name, before in routers.items():  # and into the router's columns, so routing is unchanged
        assert not torch.equal(get_module(block, name).weight, before)
    torch.testing.assert_close(logits(model), reference, rtol=1e-4, atol=1e-4)
