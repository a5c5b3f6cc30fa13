"""ZeroQuant: group-wise weights with per-token activations, and LKD lowering the quantized block's error."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.cli import main


@pytest.fixture
def calib() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("lkd_inputs", ["float", "quantized"])
def test_lkd_lowers_block_error_at_w4a8(model_kind, make_model, calib, lkd_inputs):
    base = make_model(model_kind)
    scheme = lq.parse_scheme("w4a8-g32")
    plain = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(lkd=False), scheme, calib=calib, progress=False)
    lkd = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(steps=40, lr=1e-3, lkd_inputs=lkd_inputs), scheme,
                      calib=calib, progress=False)
    assert sum(b.output_rel_error for b in lkd.llmeasyquant.blocks) < sum(
        b.output_rel_error for b in plain.llmeasyquant.blocks)
    layers = [m for m in lkd.modules() if isinstance(m, lq.QuantLinear)]
    assert layers and all(m.scheme == scheme for m in layers)
    assert not any(p.grad is not None for p in lkd.parameters())


def test_without_lkd_zeroquant_is_rtn(make_model, calib):
    base = make_model("llama")
    scheme = lq.parse_scheme("w4a8-g32")
    zq = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(lkd=False), scheme, calib=calib, progress=False)
    rtn = lq.quantize(copy.deepcopy(base), lq.RTN(), scheme, progress=False)
    a, b = zq.state_dict(), rtn.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lkd_is_deterministic(make_model, calib):
    base = make_model("llama")
    scheme = lq.parse_scheme("w4a8-g32")
    a = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(steps=5), scheme, calib=calib, progress=False).state_dict()
    b = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(steps=5), scheme, calib=calib, progress=False).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_float_path_carries_the_unquantized_models_activations(make_model, calib):
    """With lkd_inputs="float", block k distils on what block k receives in the unquantized model."""
    base = make_model("llama")
    with torch.no_grad():
        hidden = base(calib, output_hidden_states=True).hidden_states  # hidden[k]: block k's input
    seen = []

    class Spy(lq.ZeroQuant):
        def apply(self, block, ctx):
            seen.append((torch.stack(ctx.float_inputs)[:, 0], torch.stack(ctx.inputs)[:, 0]))
            super().apply(block, ctx)

    lq.quantize(copy.deepcopy(base), Spy(steps=2), lq.parse_scheme("w4a8-g32"), calib=calib, progress=False)
    for k, (float_inputs, quantized_inputs) in enumerate(seen):
        torch.testing.assert_close(float_inputs, hidden[k], rtol=1e-5, atol=1e-5)
        if k > 0:  # after a quantized block the two paths part
            assert not torch.allclose(quantized_inputs, hidden[k], rtol=1e-3, atol=1e-3)


def test_lkd_samples_limits_the_training_data(make_model, calib):
    base = make_model("llama")
    scheme = lq.parse_scheme("w4a8-g32")
    two = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(steps=6, samples=2), scheme, calib=calib, progress=False)
    also_two = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(steps=6, samples=2), scheme, calib=calib[:2],
                           progress=False)
    a, b = two.state_dict(), also_two.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("options", [{"steps": -1}, {"lr": 0.0}, {"samples": 0}, {"lkd_inputs": "both"}])
def test_bad_options(options):
    with pytest.raises(lq.ConfigError, match="ZeroQuant"):
        lq.ZeroQuant(**options)


def test_cli_zeroquant(llama_folder, wiki_text, tmp_path):
    out = tmp_path / "zq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "zeroquant", "--bits", "4", "--group-size",
                 "32", "--act-bits", "8", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert model.llmeasyquant.recipe[0]["method"] == "zeroquant"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "zeroquant", "--bits", "4", "--group-size",
                 "32", "--act-bits", "8", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--lkd-steps", "3", "--lkd-lr", "1e-4", "--lkd-samples", "2", "--lkd-inputs", "quantized",
                 "--out", str(out), "--force"]) == 0
    recipe = lq.load(out)[0].llmeasyquant.recipe[0]
    assert (recipe["steps"], recipe["lr"], recipe["samples"], recipe["lkd_inputs"]) == (3, 1e-4, 2, "quantized")
