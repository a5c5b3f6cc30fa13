"""Static activation scales: one calibrated per-tensor scale per layer, stored in the checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.calibration.sequential import capture_block_inputs
from llmeasyquant.cli import main
from llmeasyquant.methods import SmoothQuant
from llmeasyquant.methods.stats import calibrate_static_inputs, collect_input_stats, static_input_layers
from llmeasyquant.models.arch import blocks_of
from llmeasyquant.scheme import ActMode, ActScheme, PerTensor, PerToken, make_scheme

STATIC = lq.parse_scheme("w8a8-astatic")


@pytest.fixture
def calib() -> torch.Tensor:
    return torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(11))


def test_scheme_names_and_errors():
    assert STATIC.static_act and STATIC.act.granularity == PerTensor() and STATIC.name == "w8a8-astatic"
    assert lq.parse_scheme("w8a8-astatic-aasym").name == "w8a8-astatic-aasym"
    assert lq.QuantScheme.from_dict(STATIC.to_dict()) == STATIC
    assert make_scheme(8, act_bits=8, static_act=True) == STATIC
    assert not lq.W8A8.static_act and not lq.W8A16.static_act
    with pytest.raises(lq.ConfigError, match="without quantized activations"):
        lq.parse_scheme("w8a16-astatic")
    with pytest.raises(lq.ConfigError, match="--act-bits 8"):
        make_scheme(8, static_act=True)
    with pytest.raises(lq.ConfigError, match="per tensor"):
        ActScheme(mode=ActMode.STATIC, granularity=PerToken())


@pytest.mark.parametrize("symmetric", [True, False])
def test_static_layer_uses_its_stored_scale_on_every_kernel(symmetric):
    scheme = lq.QuantScheme(bits=8, act=ActScheme(symmetric=symmetric, mode=ActMode.STATIC, granularity=PerTensor()))
    torch.manual_seed(0)
    layer = lq.QuantLinear.from_weight(torch.randn(24, 48), torch.randn(24), scheme)
    x = torch.randn(5, 48) * 2 + (1.0 if not symmetric else 0.0)
    with pytest.raises(lq.ConfigError, match="never calibrated"):
        layer(x)
    layer.set_input_range(float(x.min()), float(x.max()))
    assert layer.input_scale.dtype == torch.float16
    scale = float(layer.input_scale)
    if symmetric:
        assert scale >= float(x.abs().max()) / 127 and layer.input_zero is None
    # The reference arithmetic, written out: codes from the one stored scale, the same for every token.
    zero = 0 if layer.input_zero is None else int(layer.input_zero)
    codes = torch.clamp(torch.round(x / scale) + zero, -128, 127)
    expected = (codes - zero) * scale @ layer.dequantize().t() + layer.bias
    outputs = {}
    for kernel in ("reference", "cpu_int_mm_w8a8"):
        layer.kernel_name, layer._kernel = kernel, None
        outputs[kernel] = layer(x)
        torch.testing.assert_close(outputs[kernel], expected, rtol=1e-5, atol=1e-4)
    # A token far outside the calibrated range is clipped (a dynamic scale would have followed it).
    loud = x.clone()
    loud[0] *= 100
    assert not torch.allclose(layer(loud)[0], loud[0] @ layer.dequantize().t() + layer.bias, rtol=0.1)


def test_quantize_calibrates_every_layer_and_the_checkpoint_keeps_the_scales(tiny_llama, calib, random_ids,
                                                                           tmp_path):
    base = copy.deepcopy(tiny_llama)
    model = lq.quantize(tiny_llama, lq.RTN(), STATIC, calib=calib, progress=False)
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    assert layers and all(m.static_input and torch.isfinite(m.input_scale).all() for m in layers)
    # Block 0's q_proj reads the first norm's output: its scale is that tensor's absmax / 127, rounded up to fp16.
    inputs, kwargs = capture_block_inputs(base, calib)
    stats, _ = collect_input_stats(blocks_of(base)[0], ["self_attn.q_proj"], inputs, kwargs,
                                   want=frozenset({"range"}))
    absmax = float(stats.absmax["self_attn.q_proj"].max())
    q_proj = model.model.layers[0].self_attn.q_proj
    assert absmax / 127 <= float(q_proj.input_scale) <= absmax / 127 * (1 + 2**-10)
    with torch.no_grad():
        logits = model(random_ids).logits
    loaded, _ = lq.load(lq.save(model, tmp_path / "static"))
    assert torch.equal(loaded.model.layers[0].self_attn.q_proj.input_scale, q_proj.input_scale)
    with torch.no_grad():
        torch.testing.assert_close(loaded(random_ids).logits, logits, rtol=0, atol=0)


def test_static_scales_need_calibration_data(tiny_llama):
    with pytest.raises(lq.ConfigError, match="static activation scales needs calibration data"):
        lq.quantize(tiny_llama, lq.RTN(), STATIC, progress=False)


def test_static_scales_outside_the_blocks_are_refused(tiny_llama, calib):
    plan = lq.Plan((lq.Rule("lm_head", STATIC), lq.Rule(".*", STATIC)))
    with pytest.raises(lq.ConfigError, match="outside the transformer blocks"):
        lq.quantize(tiny_llama, lq.RTN(), plan, calib=calib, progress=False)


def test_ranges_carried_through_smoothing_equal_a_fresh_measurement(model_kind, make_model, calib):
    """SmoothQuant hands on the input ranges divided by its scales; measuring them again must agree."""
    model = make_model(model_kind)
    plan = lq.Plan.uniform(STATIC).resolve(model)
    inputs, kwargs = capture_block_inputs(model, calib)
    block = blocks_of(model)[0]
    prefix = next(iter(plan)).rsplit(".", 2)[0]
    block_plan = {name[len(prefix) + 1:]: s for name, s in plan.items() if name.startswith(prefix + ".")}
    ctx = lq.methods.BlockContext(index=0, prefix=prefix + ".", plan=block_plan, arch=lq.models.arch.arch_for(model),
                                  inputs=inputs, kwargs=kwargs)
    SmoothQuant(alpha=0.5).apply(block, ctx)
    carried = ctx.input_stats
    fresh, _ = collect_input_stats(block, list(block_plan), inputs, kwargs, want=frozenset({"range"}))
    for name in block_plan:
        torch.testing.assert_close(carried.lo[name], fresh.lo[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(carried.hi[name], fresh.hi[name], rtol=1e-4, atol=1e-5)
    # Without carried ranges the scales come from a pass over the quantized block; both give usable scales.
    lq.RTN().apply(block, ctx)
    calibrate_static_inputs(block, None, inputs, kwargs)
    assert all(torch.isfinite(m.input_scale).all() for m in static_input_layers(block).values())


def test_cli_static_smoothquant(llama_folder, wiki_text, tmp_path, capsys):
    out = tmp_path / "sq-static"
    assert main(["--quiet", "quantize", str(llama_folder), "--act-bits", "8", "--static", "--out", str(out)]) == 2
    assert "static activation scales needs calibration text" in capsys.readouterr().err
    assert main(["--quiet", "quantize", str(llama_folder), "--static", "--calib", str(wiki_text),
                 "--out", str(out)]) == 2
    assert "--act-bits 8" in capsys.readouterr().err
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "smoothquant", "--alpha", "0.8",
                 "--act-bits", "8", "--static", "--calib", str(wiki_text), "--calib-samples", "4",
                 "--calib-seqlen", "32", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    assert all(m.scheme == STATIC and torch.isfinite(m.input_scale).all() for m in layers)
