"""RTN through quantize() on tiny random llama and gpt2 models: structure, weights, logits, errors, the runner."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import llmeasyquant as lq
from llmeasyquant.calibration.sequential import capture_block_inputs, run_sequential
from llmeasyquant.methods import Quantizer, Transform
from llmeasyquant.models.arch import arch_for, linear_weight

SCHEMES = ["w8a16", "w8a8", "w4a16-g32-asym", "w4a16-g48", "w4a16-g64", "w3a16-g32", "w2a16-g32-asym",
           "w4a16-g48-asym", "w8a16-pt", "w8a16-g32-asym", "w8a8-asym", "w4a16-g256"]
# Linear layers per block, by family.
BLOCK_LINEARS = {
    "llama": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"],
    "gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
}
# Upper bounds on ||logits_q - logits|| / ||logits|| by weight bits (8-bit at most ~1%, measured ~0.6-0.8%).
MAX_REL_LOGIT_ERROR = {8: 0.03, 4: 0.25, 3: 0.5, 2: 0.8}


def _quantize(model: nn.Module, scheme: str | lq.QuantScheme, **kw) -> nn.Module:
    scheme = lq.parse_scheme(scheme) if isinstance(scheme, str) else scheme
    return lq.quantize(model, lq.RTN(), scheme, progress=False, **kw)


@pytest.fixture(scope="module")
def quantized_pairs(make_model) -> dict:
    """(float model, quantized copy) per (family, scheme), built once for the module; tests only read them."""
    cache: dict = {}

    def get(kind: str, scheme: str) -> tuple[nn.Module, nn.Module]:
        if (kind, scheme) not in cache:
            base = make_model(kind)
            cache[kind, scheme] = (base, _quantize(copy.deepcopy(base), scheme))
        return cache[kind, scheme]

    return get


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def _block_linear_names(kind: str) -> list[str]:
    prefix = {"llama": "model.layers", "gpt2": "transformer.h"}[kind]
    return [f"{prefix}.{i}.{rel}" for i in range(2) for rel in BLOCK_LINEARS[kind]]


# structure ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_block_linear_becomes_quantlinear(quantized_pairs, model_kind: str, scheme: str) -> None:
    base, model = quantized_pairs(model_kind, scheme)
    expected = lq.parse_scheme(scheme)
    names = _block_linear_names(model_kind)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)}
    assert sorted(quantized) == sorted(names)
    for name in names:
        layer = quantized[name]
        assert layer.scheme == expected
        out_features, in_features = linear_weight(base.get_submodule(name)).shape
        assert (layer.out_features, layer.in_features) == (out_features, in_features)
        if expected.group_size is not None:  # partial last group when the width is not a multiple
            assert layer.scales.shape == (out_features, -(-in_features // expected.group_size))
        elif scheme.endswith("-pt"):
            assert torch.unique(layer.scales).numel() == 1
        else:
            assert layer.scales.shape == (out_features, 1)
        assert (layer.zeros is None) == expected.symmetric
    # No float linear is left inside the blocks; the head and the embeddings stay float.
    blocks = arch_for(model).blocks + "."
    leftovers = [n for n, m in model.named_modules() if n.startswith(blocks) and isinstance(m, nn.Linear | Conv1D)]
    assert leftovers == []
    assert type(model.lm_head) is nn.Linear
    embeddings = [model.get_submodule(e) for e in arch_for(model).embeddings]
    assert all(type(e) is nn.Embedding for e in embeddings)
    # Tied head and embeddings remain one tensor.
    assert model.lm_head.weight is embeddings[0].weight


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_weights_within_half_a_step(quantized_pairs, model_kind: str, scheme: str) -> None:
    base, model = quantized_pairs(model_kind, scheme)
    bits = lq.parse_scheme(scheme).bits
    # Half a step, plus what storing the scale in fp16 can cost at the range ends (scale rounded down by at
    # most 2^-11 relative, over 2^bits - 1 steps).
    allowed_steps = 0.5 + (2**bits - 1) * 2.0**-11
    for name in _block_linear_names(model_kind):
        layer = model.get_submodule(name)
        original = base.get_submodule(name)
        weight = original.weight.t() if isinstance(original, Conv1D) else original.weight  # [out, in]
        codes = layer.codes()
        assert codes.dtype == torch.int8
        assert int(codes.min()) >= -(2 ** (bits - 1)) and int(codes.max()) <= 2 ** (bits - 1) - 1
        deq = layer.dequantize()
        assert deq.shape == weight.shape
        step = layer.scales.float().repeat_interleave(layer.group_size, dim=1)[:, : layer.in_features]
        err = (deq - weight.detach().float()).abs()
        assert bool((err <= allowed_steps * step + 1e-8).all()), \
            f"{name}: worst error {float((err / step).max()):.4f} steps"
        # A grid that is too coarse would also pass the line above; the scales must fit the weights' range.
        assert float((err / step).max()) > 0.3


@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_stay_close_to_the_float_model(quantized_pairs, model_kind: str, scheme: str,
                                              random_ids: torch.Tensor) -> None:
    base, model = quantized_pairs(model_kind, scheme)
    ref, out = _logits(base, random_ids), _logits(model, random_ids)
    rel = float((out - ref).norm() / ref.norm())
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    bits = lq.parse_scheme(scheme).bits
    assert 0 < rel < MAX_REL_LOGIT_ERROR[bits]
    if bits == 8:
        assert top1 >= 0.95
    else:
        assert top1 >= 0.8


def test_error_grows_as_bits_shrink(quantized_pairs, model_kind: str, random_ids: torch.Tensor) -> None:
    errors = []
    for scheme in ("w8a16", "w4a16-g32-asym", "w2a16-g32-asym"):
        base, model = quantized_pairs(model_kind, scheme)
        ref = _logits(base, random_ids)
        errors.append(float((_logits(model, random_ids) - ref).norm() / ref.norm()))
    assert errors[0] < errors[1] < errors[2]


def test_gpt2_conv1d_layer_computes_like_the_original(tiny_gpt2) -> None:
    """GPT-2's Conv1D computes x @ W with W [in, out]; its QuantLinear must compute the same (nearly)."""
    conv = tiny_gpt2.transformer.h[0].mlp.c_fc  # in 64, out 256
    model = _quantize(copy.deepcopy(tiny_gpt2), "w8a16", keep_fp32=True)
    layer = model.transformer.h[0].mlp.c_fc
    assert (layer.in_features, layer.out_features) == (64, 256)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = conv(x), layer(x)
    assert float((out - ref).norm() / ref.norm()) < 0.02
    assert torch.equal(layer.bias, conv.bias)


def test_unquantized_tensors_rounded_to_fp16_values(tiny_llama) -> None:
    norm = tiny_llama.model.norm.weight.detach().clone()
    with torch.no_grad():
        tiny_llama.model.embed_tokens.weight[0, 0] = 0.1  # not an fp16 value
    emb = tiny_llama.model.embed_tokens.weight.detach().clone()
    model = _quantize(tiny_llama, "w8a16")
    assert model.llmeasyquant.float_dtype == "float16"
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, emb.half().float())
    assert not torch.equal(model.model.embed_tokens.weight, emb)
    assert torch.equal(model.model.norm.weight, norm.half().float())


def test_keep_fp32_leaves_float_tensors_alone(tiny_llama) -> None:
    with torch.no_grad():
        tiny_llama.model.embed_tokens.weight[0, 0] = 0.1
    emb = tiny_llama.model.embed_tokens.weight.detach().clone()
    model = _quantize(tiny_llama, "w8a16", keep_fp32=True)
    assert model.llmeasyquant.float_dtype == "float32"
    assert torch.equal(model.model.embed_tokens.weight, emb)


def test_quantization_info_is_attached(tiny_llama) -> None:
    model = _quantize(tiny_llama, "w4a16-g32-asym")
    info = model.llmeasyquant
    assert info.recipe == [{"method": "rtn"}]
    assert info.source == "tiny-random-llama"
    assert info.plan["rules"][0]["scheme"]["bits"] == 4
    assert info.quantize_s >= 0
    assert [b.index for b in info.blocks] == [0, 1]
    assert all(b.layers == 7 and b.output_rel_error is None for b in info.blocks)  # no calibration data


# determinism -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16-g32-asym", "w3a16-g32"])
def test_quantizing_two_copies_is_bit_identical(make_model, model_kind: str, scheme: str) -> None:
    base = make_model(model_kind)
    a = _quantize(copy.deepcopy(base), scheme).state_dict()
    b = _quantize(copy.deepcopy(base), scheme).state_dict()
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def test_calibration_data_does_not_change_rtn(make_model, model_kind: str, random_ids: torch.Tensor) -> None:
    plain = _quantize(make_model(model_kind), "w4a16-g32-asym").state_dict()
    with_data = _quantize(make_model(model_kind), "w4a16-g32-asym", calib=random_ids).state_dict()
    assert all(torch.equal(plain[k], with_data[k]) for k in plain)


# plan --------------------------------------------------------------------------------------------------------


def test_a_rule_naming_lm_head_quantizes_it_and_unties(tiny_llama, random_ids: torch.Tensor) -> None:
    emb = tiny_llama.model.embed_tokens.weight.detach().clone()
    plan = lq.Plan((lq.Rule("lm_head", lq.W8A16), lq.Rule(".*", lq.W8A16)))
    model = lq.quantize(tiny_llama, lq.RTN(), plan, progress=False, keep_fp32=True)
    assert isinstance(model.lm_head, lq.QuantLinear)
    assert model.config.tie_word_embeddings is False
    assert type(model.model.embed_tokens) is nn.Embedding
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert torch.allclose(model.lm_head.dequantize(), emb, atol=float(model.lm_head.scales.max()) / 2 + 1e-6)
    assert torch.isfinite(_logits(model, random_ids)).all()


def test_skip_rule_leaves_layers_float(tiny_llama) -> None:
    plan = lq.Plan((lq.Rule(r".*\.mlp\..*", None), lq.Rule(".*", lq.W8A16)))
    model = lq.quantize(tiny_llama, lq.RTN(), plan, progress=False)
    for i in range(2):
        assert isinstance(model.model.layers[i].self_attn.q_proj, lq.QuantLinear)
        assert type(model.model.layers[i].mlp.down_proj) is nn.Linear
    assert [b.layers for b in model.llmeasyquant.blocks] == [4, 4]


# rejected inputs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NoopTransform(Transform):
    name: ClassVar[str] = "noop"
    needs_calibration: ClassVar[bool] = False

    def apply(self, block: nn.Module, ctx) -> None:
        pass


@pytest.mark.parametrize("recipe, match", [
    ([], "empty"),
    ((), "empty"),
    ([_NoopTransform()], "one quantizer"),
    ([lq.RTN(), lq.RTN()], "one quantizer"),
    ([lq.RTN(), _NoopTransform()], "one quantizer"),
    (["rtn"], "method objects"),
    ("rtn", "method objects"),
])
def test_bad_recipes_are_config_errors(tiny_llama, recipe, match: str) -> None:
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    with pytest.raises(lq.ConfigError, match=match):
        lq.quantize(tiny_llama, recipe, lq.W8A16, progress=False)
    assert not any(isinstance(m, lq.QuantLinear) for m in tiny_llama.modules())
    assert all(torch.equal(before[k], v) for k, v in tiny_llama.state_dict().items())


def test_already_quantized_model_is_rejected(tiny_gpt2) -> None:
    model = _quantize(tiny_gpt2, "w8a16")
    with pytest.raises(lq.ConfigError, match="quantized already"):
        _quantize(model, "w4a16-g32-asym")


@pytest.mark.parametrize("plan", [
    lq.Plan((lq.Rule("nothing-matches-this", lq.W8A16),)),
    lq.Plan((lq.Rule(".*", None),)),
    lq.Plan(()),
])
def test_plan_selecting_nothing_is_rejected(model_kind: str, make_model, plan: lq.Plan) -> None:
    model = make_model(model_kind)
    with pytest.raises(lq.ConfigError, match="selects no linear layer"):
        lq.quantize(model, lq.RTN(), plan, progress=False)
    assert not any(isinstance(m, lq.QuantLinear) for m in model.modules())


def test_unsupported_family_is_rejected() -> None:
    class Fake(nn.Module):
        config = type("Config", (), {"model_type": "bert"})()

    with pytest.raises(lq.ConfigError, match="'bert' is not supported"):
        lq.quantize(Fake(), lq.RTN(), lq.W8A16, progress=False)


@pytest.mark.parametrize("kind, layer, bad", [
    ("llama", "model.layers.1.mlp.down_proj", float("nan")),
    ("llama", "model.layers.0.self_attn.k_proj", float("inf")),
    ("gpt2", "transformer.h.1.attn.c_attn", float("nan")),
])
def test_non_finite_weight_is_a_data_error_naming_the_layer(make_model, kind: str, layer: str, bad: float) -> None:
    model = make_model(kind)
    with torch.no_grad():
        model.get_submodule(layer).weight[3, 5] = bad
    with pytest.raises(lq.DataError, match=layer.replace(".", r"\.")) as info:
        _quantize(model, "w4a16-g32-asym")
    assert "1 NaN or infinite" in str(info.value)


# the sequential runner with calibration data -----------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["w8a16", "w2a16-g32-asym"])
def test_runner_reports_block_output_errors(make_model, model_kind: str, scheme: str,
                                            random_ids: torch.Tensor) -> None:
    model = _quantize(make_model(model_kind), scheme, calib=random_ids)
    reports = model.llmeasyquant.blocks
    assert [r.index for r in reports] == [0, 1]
    assert [r.layers for r in reports] == [len(BLOCK_LINEARS[model_kind])] * 2
    for r in reports:
        assert isinstance(r.output_rel_error, float)
        assert 0 < r.output_rel_error < (0.03 if scheme == "w8a16" else 1.0)


def test_runner_errors_grow_as_bits_shrink(make_model, random_ids: torch.Tensor) -> None:
    errors = {}
    for scheme in ("w8a16", "w4a16-g32-asym", "w2a16-g32-asym"):
        model = _quantize(make_model("llama"), scheme, calib=random_ids)
        errors[scheme] = [r.output_rel_error for r in model.llmeasyquant.blocks]
    for i in range(2):
        assert errors["w8a16"][i] < errors["w4a16-g32-asym"][i] < errors["w2a16-g32-asym"][i]


def test_runner_block_errors_match_a_hand_computation(make_model, model_kind: str,
                                                      random_ids: torch.Tensor) -> None:
    """Each block's reported error is ||q_block(x) - float_block(x)|| / ||float_block(x)||, where x are the
    outputs of the already-quantized previous blocks."""
    base = make_model(model_kind)
    model = _quantize(copy.deepcopy(base), "w4a16-g32-asym", calib=random_ids, keep_fp32=True)
    quant_blocks = model.get_submodule(arch_for(model).blocks)
    float_blocks = base.get_submodule(arch_for(base).blocks)
    calls: list[list[tuple]] = [[] for _ in quant_blocks]
    handles = [block.register_forward_hook(
        lambda _m, args, kwargs, out, i=i: calls[i].append((args, kwargs, out)), with_kwargs=True)
        for i, block in enumerate(quant_blocks)]
    try:
        with torch.no_grad():
            for row in random_ids:
                model(row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for i, report in enumerate(model.llmeasyquant.blocks):
        num = den = 0.0
        for args, kwargs, out in calls[i]:
            with torch.no_grad():
                ref = float_blocks[i](*args, **kwargs)
            ref = ref[0] if isinstance(ref, tuple) else ref
            out = out[0] if isinstance(out, tuple) else out
            num += float((out - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
        assert report.output_rel_error == pytest.approx((num / den) ** 0.5, rel=1e-4)


def test_run_sequential_directly(tiny_gpt2, make_model, random_ids: torch.Tensor) -> None:
    plan = lq.Plan.uniform(lq.W8A8).resolve(tiny_gpt2)
    assert len(plan) == 8
    reports = run_sequential(tiny_gpt2, [lq.RTN()], plan, random_ids, progress=False)
    assert len(reports) == 2 and all(r.output_rel_error is not None and r.output_rel_error > 0 for r in reports)
    assert sum(isinstance(m, lq.QuantLinear) for m in tiny_gpt2.modules()) == 8
    llama = make_model("llama")
    no_data = run_sequential(llama, [lq.RTN()], lq.Plan.uniform(lq.W8A16).resolve(llama), None, progress=False)
    assert [r.output_rel_error for r in no_data] == [None, None]


def test_capture_block_inputs_gives_one_entry_per_sample(tiny_llama, random_ids: torch.Tensor) -> None:
    inputs, kwargs = capture_block_inputs(tiny_llama, random_ids)
    assert len(inputs) == len(kwargs) == 4
    assert all(x.shape == (1, 32, 64) for x in inputs)
    expected = tiny_llama.model.embed_tokens(random_ids[2][None])
    assert torch.equal(inputs[2], expected)
    assert all("past_key_value" not in kw and "past_key_values" not in kw for kw in kwargs)


def test_recipe_needing_data_without_it_is_an_error(tiny_llama) -> None:
    @dataclass(frozen=True)
    class NeedsData(Quantizer):
        name: ClassVar[str] = "needsdata"
        needs_calibration: ClassVar[bool] = True

        def apply(self, block, ctx) -> None:
            raise AssertionError("must not run")

    with pytest.raises(ValueError, match="needsdata needs calibration data"):
        lq.quantize(tiny_llama, NeedsData(), lq.W8A16, progress=False)
