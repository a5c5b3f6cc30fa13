"""Online activation ranges: an EMA of each layer's input range, tracked while the model runs, no calibration."""

from __future__ import annotations

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.cli import main
from llmeasyquant.nn.observers import ema_step, observed_extremes
from llmeasyquant.scheme import ActMode, ActScheme, PerTensor, PerToken, make_scheme

ONLINE = lq.parse_scheme("w8a8-aonline")


def online_scheme(symmetric: bool = True, **options) -> lq.QuantScheme:
    act = ActScheme(symmetric=symmetric, mode=ActMode.ONLINE, granularity=PerTensor(), **options)
    return lq.QuantScheme(bits=8, act=act)


def make_layer(scheme: lq.QuantScheme) -> lq.QuantLinear:
    torch.manual_seed(0)
    return lq.QuantLinear.from_weight(torch.randn(24, 48), torch.randn(24), scheme)


def test_scheme_names_round_trip_and_refusals():
    assert ONLINE.act.mode is ActMode.ONLINE and not ONLINE.static_act and ONLINE.name == "w8a8-aonline"
    assert lq.parse_scheme("w8a8-aonline-aasym").act.symmetric is False
    custom = online_scheme(momentum=0.5, eps=1e-3, std_floor=True)
    assert lq.QuantScheme.from_dict(custom.to_dict()) == custom
    assert make_scheme(8, act_bits=8, act_mode=ActMode.ONLINE, momentum=0.5, eps=1e-3, std_floor=True) == custom
    assert lq.W8A8.act.mode is ActMode.DYNAMIC and lq.parse_scheme("w8a8-astatic").act.mode is ActMode.STATIC
    with pytest.raises(lq.ConfigError, match="dynamic=False"):  # a checkpoint's flags saying online and dynamic
        lq.QuantScheme.from_dict(custom.to_dict() | {"act": custom.to_dict()["act"] | {"dynamic": True}})
    with pytest.raises(lq.ConfigError, match="per tensor"):
        ActScheme(mode=ActMode.ONLINE, granularity=PerToken())
    with pytest.raises(lq.ConfigError, match="momentum"):
        online_scheme(momentum=1.0)
    with pytest.raises(lq.ConfigError, match="eps"):
        online_scheme(eps=0.0)
    with pytest.raises(lq.ConfigError, match="unknown activation mode"):
        make_scheme(8, act_bits=8, act_mode="sometimes")
    with pytest.raises(lq.ConfigError, match="--act-bits 8"):
        make_scheme(8, act_mode="online")


def test_ema_step_starts_from_the_first_observation_then_blends():
    start = torch.full((2,), float("nan"))
    first = ema_step(start, torch.tensor([-1.0, 2.0]), 0.9)
    assert torch.equal(first, torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(ema_step(first, torch.tensor([-3.0, 4.0]), 0.9), torch.tensor([-1.2, 2.2]))


def test_observed_extremes_floor():
    x = torch.full((4, 8), 1e-9)
    assert torch.equal(observed_extremes(x, True, 1e-5, False), torch.tensor([-1e-5, 1e-5]))
    y = torch.tensor([[0.0, 0.1, 0.2, 3.0]])
    lo, hi = observed_extremes(y, False, 1e-5, False)
    assert float(lo) == pytest.approx(-1e-5) and float(hi) == pytest.approx(3.0)
    pair = torch.tensor([[0.01, -0.01]])  # its (unbiased) std, 0.0141, exceeds its absmax
    assert float(observed_extremes(pair, True, 1e-5, True)[1]) == pytest.approx(float(pair.std()))
    assert float(observed_extremes(pair, True, 1e-5, False)[1]) == pytest.approx(0.01)


@pytest.mark.parametrize("symmetric", [True, False])
def test_layer_tracks_the_range_and_quantizes_with_range_over_qmax(symmetric):
    momentum = 0.75
    layer = make_layer(online_scheme(symmetric, momentum=momentum))
    x1, x2 = torch.randn(5, 48) * 2 + (1.0 if not symmetric else 0.0), torch.randn(3, 48) * 6
    layer(x1)
    lo, hi = (float(x1.min()), float(x1.max())) if not symmetric else (-float(x1.abs().max()), float(x1.abs().max()))
    torch.testing.assert_close(layer.input_range, torch.tensor([min(lo, -1e-5), hi]))
    y2 = layer(x2)
    lo2, hi2 = (float(x2.min()), float(x2.max())) if not symmetric else (-float(x2.abs().max()),
                                                                           float(x2.abs().max()))
    tracked = torch.tensor([momentum * min(lo, -1e-5) + (1 - momentum) * lo2, momentum * hi + (1 - momentum) * hi2])
    torch.testing.assert_close(layer.input_range, tracked)
    # The step is the range over the integer range (never the range itself), stored in fp16 like a static scale.
    steps = 127 if symmetric else 255
    width = max(-float(tracked[0]), float(tracked[1])) if symmetric else float(tracked[1] - tracked[0])
    scale = float(layer.input_scale)
    assert width / steps <= scale <= width / steps * (1 + 2**-10)
    zero = 0 if layer.input_zero is None else int(layer.input_zero)
    codes = torch.clamp(torch.round(x2 / scale) + zero, -128, 127)  # x2 exceeds the tracked range: clipped
    assert int((codes == 127).sum() + (codes == -128).sum()) > 0
    expected = (codes - zero) * scale @ layer.dequantize().t() + layer.bias
    torch.testing.assert_close(y2, expected, rtol=1e-5, atol=1e-4)


def test_fast_kernel_and_reference_agree_on_a_stream():
    fast, ref = make_layer(ONLINE), make_layer(ONLINE)
    ref.kernel_name = "reference"
    for step in range(4):
        x = torch.randn(1 if step else 7, 48) * (step + 1)
        torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-4)
        assert torch.equal(fast.input_range, ref.input_range)
    assert fast.kernel().name == "cpu_int_mm_w8a8"


def test_model_needs_no_calibration_and_checkpoint_keeps_the_tracked_range(tiny_llama, random_ids, tmp_path):
    model = lq.quantize(tiny_llama, lq.RTN(), ONLINE, progress=False)
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    assert layers and all(torch.isnan(m.input_range).all() for m in layers)
    with torch.no_grad():
        model(random_ids)
    assert all(torch.isfinite(m.input_range).all() and torch.isfinite(m.input_scale).all() for m in layers)
    loaded, _ = lq.load(lq.save(model, tmp_path / "online"))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert torch.equal(loaded.model.layers[0].self_attn.q_proj.input_range, q_proj.input_range)
    with torch.no_grad():  # the saved state continues the stream exactly as the live model does
        torch.testing.assert_close(loaded(random_ids).logits, model(random_ids).logits, rtol=0, atol=0)


def test_cli_online_needs_no_calibration(llama_folder, tmp_path, capsys):
    out = tmp_path / "online"
    assert main(["--quiet", "quantize", str(llama_folder), "--act-bits", "8", "--act-mode", "online",
                 "--act-momentum", "0.8", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    schemes = {m.scheme for m in model.modules() if isinstance(m, lq.QuantLinear)}
    assert schemes == {online_scheme(momentum=0.8)}
    assert main(["--quiet", "quantize", str(llama_folder), "--act-bits", "8", "--act-mode", "online", "--static",
                 "--out", str(tmp_path / "both")]) == 2
    assert "--static contradicts --act-mode online" in capsys.readouterr().err


def test_an_export_freezes_the_scale_in_use(tiny_llama, random_ids, tmp_path):
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open

    from llmeasyquant.export.compressed import export_compressed_tensors

    model = lq.quantize(tiny_llama, lq.RTN(), ONLINE, progress=False)
    with torch.no_grad():
        model(random_ids)
    result = export_compressed_tensors(model, None, tmp_path / "ct")
    with safe_open(str(result.path / "model.safetensors"), framework="pt") as f:
        for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)):
            assert torch.equal(f.get_tensor(f"{name}.input_scale").float().reshape(1), layer.input_scale.float())
    fresh = lq.quantize(tiny_llama.__class__(tiny_llama.config), lq.RTN(), ONLINE, progress=False)
    with pytest.raises(lq.ConfigError, match="has seen no input yet"):  # no scale to freeze
        export_compressed_tensors(fresh, None, tmp_path / "ct2")
