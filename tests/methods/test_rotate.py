"""Rotate: an orthogonal matrix of any size, the float function unchanged (tied and untied heads, biases), outliers of
the residual stream spread, W8A8 error lower, the checkpoint round trip, the refusals and the CLI; the online
Hadamard transform of the down-projection's input: float function unchanged, carried onto the quantized layers,
seen by the calibration statistics, kept by the checkpoint, run by the lean decoder, refused by the exporters."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.cli import main
from llmeasyquant.export.formats import export
from llmeasyquant.methods import Rotate, recipe_by_name
from llmeasyquant.methods.rotate import rotation_matrix, walsh_hadamard
from llmeasyquant.methods.smoothquant import foldable
from llmeasyquant.models.arch import arch_for
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import input_transform_of

VOCAB = 256


def untied_llama_with_biases() -> LlamaForCausalLM:
    """Hidden size 96 = 32 * 3 (a Hadamard part and an odd part), biases on every projection, untied head."""
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms that are not all ones, so that folding them matters
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def with_residual_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Two channels of the residual stream 30x larger from the embeddings on (the norms scale them back down)."""
    with torch.no_grad():
        model.get_input_embeddings().weight[:, [5, 40]] *= 30.0
    return model


@pytest.mark.parametrize("size", [1, 8, 64, 96, 576, 1536])
def test_rotation_matrix_is_orthogonal_and_seeded(size):
    q = rotation_matrix(size, seed=7)
    torch.testing.assert_close(q @ q.T, torch.eye(size, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(q, rotation_matrix(size, seed=7))
    if size > 1:
        assert not torch.equal(q, rotation_matrix(size, seed=8))


def test_walsh_hadamard_rows_are_orthogonal_signs():
    h = walsh_hadamard(16)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, 16 * torch.eye(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        walsh_hadamard(12)


@pytest.mark.parametrize("build", ["tied", "untied"])
def test_rotation_leaves_the_float_function_unchanged(build, make_model, random_ids):
    model = make_model("llama") if build == "tied" else untied_llama_with_biases()
    with torch.no_grad():
        before = model(random_ids).logits
        Rotate(seed=1).apply_model(model, arch_for(model))
        after = model(random_ids).logits
    torch.testing.assert_close(after, before, atol=2e-4, rtol=2e-4)
    if build == "tied":
        assert model.lm_head.weight is not model.get_input_embeddings().weight
        assert model.config.tie_word_embeddings is False
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for n, m in model.named_modules()
               if n.endswith("norm"))


def _block_input_peak(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """max |h| / RMS(h) of the second block's input: how far the largest channel stands out."""
    seen: list[torch.Tensor] = []
    handle = model.model.layers[1].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    h = seen[0]
    return float(h.abs().amax() / h.pow(2).mean().sqrt())


def test_rotation_spreads_the_residual_outliers(make_model, random_ids):
    model = with_residual_outliers(make_model("llama"))
    before = _block_input_peak(model, random_ids)
    Rotate().apply_model(model, arch_for(model))
    after = _block_input_peak(model, random_ids)
    assert after < before / 3, (before, after)


def test_rotation_lowers_the_w8a8_error_under_residual_outliers(make_model, random_ids):
    reference = with_residual_outliers(make_model("llama"))
    with torch.no_grad():
        target = reference(random_ids).logits
    errors = {}
    for recipe in ("rtn", "rotate+rtn"):
        model = lq.quantize(copy.deepcopy(reference), recipe_by_name(recipe), lq.W8A8, progress=False)
        with torch.no_grad():
            errors[recipe] = float((model(random_ids).logits - target).pow(2).mean())
    assert errors["rotate+rtn"] < errors["rtn"] / 2, errors


def test_rotated_checkpoint_round_trips(make_model, random_ids, tmp_path):
    model = lq.quantize(make_model("llama"), [Rotate(), lq.RTN()], lq.W4A16_G64, progress=False)
    with torch.no_grad():
        expected = model(random_ids).logits
    lq.save(model, tmp_path / "ckpt")
    loaded, _ = lq.load(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(random_ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert [step["method"] for step in loaded.llmeasyquant.recipe] == ["rotate", "rtn"]


def test_rotation_refuses_layernorm_families_and_streaming(make_model):
    with pytest.raises(lq.ConfigError, match="LayerNorm"):
        lq.quantize(make_model("gpt2"), [Rotate(), lq.RTN()], lq.W8A16, progress=False)
    with pytest.raises(lq.ConfigError, match="--stream"):
        lq.quantize(make_model("llama"), [Rotate(), lq.RTN()], lq.W8A16, progress=False, stream=object())


def test_recipe_names_and_default_scheme():
    recipe = recipe_by_name("rotate+gptq", seed=4)
    assert [m.name for m in recipe] == ["rotate", "gptq"] and recipe[0].seed == 4
    assert [m.name for m in recipe_by_name("rotate")] == ["rotate", "rtn"]
    assert lq.api.default_scheme(recipe_by_name("rotate+smoothquant")) == lq.parse_scheme("w8a8")


def test_cli_rotate_then_gptq(llama_folder, wiki_text, tmp_path):
    out = tmp_path / "rot"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rotate+gptq", "--bits", "4",
                 "--group-size", "32", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert [r["method"] for r in model.llmeasyquant.recipe] == ["rotate", "gptq"]


# ---- the online Hadamard transform of the down-projection's input ------------------------------------------------


def with_down_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Two channels of every down-projection's input 40x larger (rows of up_proj scaled), as in real models."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[[7, 70]] *= 40.0
    return model


def downs(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.down_proj for layer in model.model.layers]


@pytest.mark.parametrize("build", ["tied", "untied"])  # intermediate sizes 128 = 2^7 and 160 = 32 * 5
def test_online_transform_leaves_the_float_function_unchanged(build, make_model, random_ids):
    model = make_model("llama") if build == "tied" else untied_llama_with_biases()
    with torch.no_grad():
        before = model(random_ids).logits
        Rotate(seed=2, online_down=True).apply_model(model, arch_for(model))
        after = model(random_ids).logits
    torch.testing.assert_close(after, before, atol=2e-4, rtol=2e-4)
    transforms = [input_transform_of(m) for m in downs(model)]
    assert all(t is not None and t.width == model.config.intermediate_size for t in transforms)
    assert transforms[0] is not transforms[1]  # each layer its own buffers: checkpoints store each


def test_online_transform_spreads_the_down_projection_outliers(make_model, random_ids):
    model = with_down_outliers(make_model("llama"))
    Rotate(online_down=True).apply_model(model, arch_for(model))
    seen: list[torch.Tensor] = []
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    with torch.no_grad():
        model(random_ids)
    x = seen[0]  # what the weights read: the pre-hook ran before the forward hook
    assert float(x.abs().amax() / x.pow(2).mean().sqrt()) < 8.0


def test_online_transform_lowers_the_w8a8_error_under_down_outliers(make_model, random_ids):
    reference = with_down_outliers(make_model("llama"))
    with torch.no_grad():
        target = reference(random_ids).logits
    errors = {}
    for online in (False, True):
        model = lq.quantize(copy.deepcopy(reference), [Rotate(online_down=online), lq.RTN()], lq.W8A8,
                            progress=False)
        assert all(isinstance(m, QuantLinear) and (m.input_transform is not None) == online for m in downs(model))
        with torch.no_grad():
            errors[online] = float((model(random_ids).logits - target).pow(2).mean())
    assert errors[True] < errors[False] / 2, errors


def test_gptq_hessian_is_that_of_the_transformed_input(make_model, random_ids):
    """GPTQ W8A16 with the transform must stay near the float model: a Hessian of the untransformed input would
    steer its updates with the wrong correlations."""
    reference = with_down_outliers(make_model("llama"))
    with torch.no_grad():
        target = reference(random_ids).logits
    model = lq.quantize(copy.deepcopy(reference), [Rotate(online_down=True), lq.GPTQ()],
                        lq.parse_scheme("w4a16-g32"), calib=random_ids, progress=False)
    rtn = lq.quantize(copy.deepcopy(reference), [Rotate(online_down=True), lq.RTN()],
                      lq.parse_scheme("w4a16-g32"), progress=False)
    with torch.no_grad():
        gptq_error = float((model(random_ids).logits - target).pow(2).mean())
        rtn_error = float((rtn(random_ids).logits - target).pow(2).mean())
    assert gptq_error < rtn_error, (gptq_error, rtn_error)


def test_smoothing_skips_a_down_projection_with_an_online_transform(make_model, random_ids):
    rotated = make_model("llama")
    Rotate(online_down=True).apply_model(rotated, arch_for(rotated))
    block = rotated.model.layers[0]
    assert not foldable(block, "mlp.up_proj", ("mlp.down_proj",))
    assert foldable(block, "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))
    with pytest.raises(lq.ConfigError, match="rotated before"):  # twice would fold the transform twice
        Rotate(online_down=True).apply_model(rotated, arch_for(rotated))
    reference = make_model("llama")
    with torch.no_grad():
        target = reference(random_ids).logits
    errors = {}
    for recipe in ([Rotate(online_down=True), lq.RTN()], [Rotate(online_down=True), lq.SmoothQuant(), lq.RTN()]):
        quantized = lq.quantize(copy.deepcopy(reference), recipe, lq.W8A8, progress=False, calib=random_ids)
        with torch.no_grad():
            errors[len(recipe)] = float((quantized(random_ids).logits - target).pow(2).mean())
    assert errors[3] < 2 * errors[2], errors  # a scale folded across the transform would break the function


@pytest.mark.parametrize("where", ["down", "attention"])
def test_online_checkpoint_round_trips_and_the_lean_decoder_agrees(make_model, random_ids, tmp_path, where):
    """Either transform (the attention output's with the 4-bit clipped activations it is for) survives a checkpoint
    and runs in the lean decoder."""
    down = where == "down"
    model = lq.quantize((with_down_outliers if down else with_head_outliers)(make_model("llama")),
                        [Rotate(online_down=down, online_attention=not down), lq.RTN()],
                        lq.W8A8 if down else lq.parse_scheme("w8a4-ac90"), progress=False)
    layers = downs if down else outs
    with torch.no_grad():
        expected = model(random_ids).logits
    lq.save(model, tmp_path / "ckpt")
    transforms = json.loads((tmp_path / "ckpt" / "quantization_config.json").read_text())["input_transforms"]
    assert ("model.layers.1.mlp.down_proj" in transforms) == down
    assert ("model.layers.1.self_attn.o_proj" in transforms) != down
    loaded, _ = lq.load(tmp_path / "ckpt")
    assert all(m.scheme == layers(model)[0].scheme for m in layers(loaded))
    for original, restored in zip(layers(model), layers(loaded), strict=True):
        assert restored.input_transform is not None and restored.input_transform.odd.dtype == torch.float32
        assert torch.equal(restored.input_transform.signs, original.input_transform.signs)
        assert torch.equal(restored.input_transform.odd, original.input_transform.odd)
    with torch.no_grad():
        torch.testing.assert_close(loaded(random_ids).logits, expected, atol=1e-5, rtol=1e-5)
    # The lean decoder (and the serving engine, which shares its parts) runs the layer's forward: same logits.
    ids = random_ids[:1, :20]
    decoder = LeanDecoder(loaded, 24)
    with torch.no_grad():
        torch.testing.assert_close(decoder.prefill(ids), loaded(ids).logits[0, -1], atol=1e-4, rtol=1e-4)
    generated = decoder.generate(ids, 4)
    reference = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                pad_token_id=0)[0, 20:]
    assert torch.equal(generated, reference)


def test_lean_decoder_runs_a_float_rotated_model_with_its_online_transform(make_model, random_ids):
    """A float down projection (a plan may keep it float) applies the transform from a pre-hook: the lean decoder
    calls it whole."""
    model = make_model("llama")
    Rotate(online_down=True).apply_model(model, arch_for(model))
    ids = random_ids[:1, :16]
    with torch.no_grad():
        torch.testing.assert_close(LeanDecoder(model, 16).prefill(ids), model(ids).logits[0, -1], atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gguf", "onnx"])
def test_exporters_refuse_an_online_transform(fmt, make_model, tmp_path):
    model = lq.quantize(make_model("llama"), [Rotate(online_down=True), lq.RTN()], lq.W8A16, progress=False)
    with pytest.raises(lq.ConfigError, match=r"model\.layers\.0\.mlp\.down_proj.*online Hadamard.*"
                                            r"--no-online-rotation"):
        export(model, fmt, tmp_path / ("out.gguf" if fmt == "gguf" else "out"))
    offline = lq.quantize(make_model("llama"), [Rotate(), lq.RTN()], lq.W8A16, progress=False)
    if fmt == "compressed-tensors":  # the offline rotation alone exports (its rotation is in the weights)
        assert export(offline, fmt, tmp_path / "offline").path.is_dir()


def test_cli_online_rotation(llama_folder, tmp_path):
    out = tmp_path / "rot"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rotate", "--online-rotation", "--bits", "8",
                 "--act-bits", "8", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert all(m.input_transform is not None for m in downs(model))
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rotate", "--no-online-rotation",
                 "--bits", "8", "--act-bits", "8", "--out", str(tmp_path / "plain")]) == 0
    plain, _ = lq.load(tmp_path / "plain")
    assert all(m.input_transform is None for m in downs(plain))


# ---- the online Hadamard transform of the attention output projection's input -------------------------------------


def outs(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn.o_proj for layer in model.model.layers]


def with_head_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Two channels of every o_proj input 20x larger (rows of v_proj scaled): heads with an outlier value channel."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[[3, 20]] *= 20.0
    return model


@pytest.mark.parametrize("build", ["tied", "untied"])  # hidden sizes 64 = 2^6 and 96 = 32 * 3
def test_online_attention_transform_leaves_the_float_function_unchanged(build, make_model, random_ids):
    model = make_model("llama") if build == "tied" else untied_llama_with_biases()
    with torch.no_grad():
        before = model(random_ids).logits
        Rotate(seed=1, online_down=True, online_attention=True).apply_model(model, arch_for(model))
        after = model(random_ids).logits
    torch.testing.assert_close(after, before, atol=2e-4, rtol=2e-4)
    assert all(input_transform_of(m).width == model.config.hidden_size for m in outs(model))
    assert all(input_transform_of(m) is not None for m in downs(model))


def test_online_attention_transform_alone_leaves_the_down_projection_alone(make_model):
    model = make_model("llama")
    Rotate(online_attention=True).apply_model(model, arch_for(model))
    assert all(input_transform_of(m) is not None for m in outs(model))
    assert all(input_transform_of(m) is None for m in downs(model))


def test_online_attention_transform_lowers_the_four_bit_activation_error(make_model, random_ids):
    reference = with_head_outliers(make_model("llama"))
    with torch.no_grad():
        target = reference(random_ids).logits
    # 4-bit activations on o_proj only, so that the error measured is the one the transform acts on.
    plan = lq.Plan((lq.Rule(r".*o_proj", lq.parse_scheme("w8a4")), lq.Rule(".*", lq.W8A16)))
    errors = {}
    for online in (False, True):
        model = lq.quantize(copy.deepcopy(reference), [Rotate(online_attention=online), lq.RTN()], plan,
                            progress=False)
        with torch.no_grad():
            errors[online] = float((model(random_ids).logits - target).pow(2).mean())
    assert errors[True] < errors[False] / 2, errors


def test_cli_online_attention_rotation(llama_folder, tmp_path):
    out = tmp_path / "rot"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rotate", "--online-attention-rotation",
                 "--bits", "8", "--act-bits", "4", "--act-clip", "0.9", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert all(m.input_transform is not None for m in outs(model))
    assert all(m.input_transform is None for m in downs(model))
    assert model.llmeasyquant.recipe[0]["online_attention"] is True
