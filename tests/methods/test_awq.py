"""AWQ: its searches never worsen a layer's output error, scaling alone keeps the function, recipes run end to end."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.calibration.sequential import run_sequential
from llmeasyquant.cli import main
from llmeasyquant.methods.awq import _rounded, output_error, search_clip, search_scales


def layer_and_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(40, 96, generator=gen) * 0.05
    x = torch.randn(256, 96, generator=gen)
    x[:, [2, 30, 77]] *= 20  # salient input channels
    return weight, 2 * x.t() @ x / x.shape[0]


@pytest.mark.parametrize("scheme", ["w4a16-g32", "w4a16-g32-asym", "w3a16-g64-asym", "w4a16", "w2a16-g32"])
def test_scale_search_never_worsens_the_layer(scheme):
    weight, h = layer_and_inputs()
    s = lq.parse_scheme(scheme)
    scales = search_scales({"w": weight}, h, {"w": s}, grid=20)
    plain = output_error(weight, _rounded(weight, s), h)
    searched = output_error(weight, _rounded(weight * scales, s) / scales, h)
    assert searched <= plain
    assert searched < 0.9 * plain  # with salient channels the search finds a real gain


@pytest.mark.parametrize("scheme", ["w4a16-g32", "w4a16-g32-asym", "w3a16-g64-asym", "w4a16"])
def test_clip_search_never_worsens_the_layer(scheme):
    weight, h = layer_and_inputs(1)
    s = lq.parse_scheme(scheme)
    clipped = search_clip(weight, h, s, grid=20, min_clip=0.5)
    assert output_error(weight, _rounded(clipped, s), h) <= output_error(weight, _rounded(weight, s), h)
    assert clipped.abs().max() <= weight.abs().max()


def test_awq_scaling_alone_keeps_the_float_function(model_kind, make_model, random_ids):
    model = make_model(model_kind)
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(random_ids).logits
    plan = lq.Plan.uniform(lq.W4A16_G64).resolve(model)
    run_sequential(model, [lq.AWQ(clip=False)], plan, calib, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(random_ids).logits, before, rtol=1e-4, atol=1e-4)


def test_awq_then_rtn_beats_rtn_on_tiny_models(model_kind, make_model):
    base = make_model(model_kind)
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(4))
    scheme = lq.parse_scheme("w3a16-g32-asym")
    rtn = lq.quantize(copy.deepcopy(base), lq.RTN(), scheme, calib=calib, progress=False)
    awq = lq.quantize(copy.deepcopy(base), [lq.AWQ(), lq.RTN()], scheme, calib=calib, progress=False)
    awq_err = sum(b.output_rel_error for b in awq.llmeasyquant.blocks)
    rtn_err = sum(b.output_rel_error for b in rtn.llmeasyquant.blocks)
    assert awq_err < rtn_err
    again = lq.quantize(copy.deepcopy(base), [lq.AWQ(), lq.RTN()], scheme, calib=calib, progress=False)
    first, second = awq.state_dict(), again.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_cli_awq_plus_gptq(llama_folder, wiki_text, tmp_path):
    out = tmp_path / "awq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "awq+gptq", "--bits", "4", "--group-size",
                 "32", "--asym", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert [r["method"] for r in model.llmeasyquant.recipe] == ["awq", "gptq"]


def test_each_method_has_a_default_scheme_used_when_none_is_given(llama_folder, wiki_text, tmp_path, capsys):
    """`--method awq` alone quantizes to W4A16 g128 asymmetric (the paper's setting), as does the API without a plan."""
    from llmeasyquant.api import default_scheme
    from llmeasyquant.cli import main
    from llmeasyquant.methods import recipe_by_name

    assert default_scheme(recipe_by_name("awq+gptq")) == lq.parse_scheme("w4a16-g128-asym")
    assert default_scheme(recipe_by_name("smoothquant+gptq")) == lq.W8A8
    assert default_scheme(recipe_by_name("rtn")) == lq.W8A16
    out = tmp_path / "awq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "awq", "--calib", str(wiki_text),
                 "--calib-samples", "4", "--calib-seqlen", "32", "--out", str(out)]) == 0
    assert "w4a16-g128-asym" in capsys.readouterr().out
    model, _ = lq.load(out)
    assert {m.scheme for m in model.modules() if isinstance(m, lq.QuantLinear)} == {lq.parse_scheme("w4a16-g128-asym")}
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "awq", "--bits", "3", "--calib", str(wiki_text),
                 "--calib-samples", "4", "--calib-seqlen", "32", "--out", str(out), "--force"]) == 0
    model, _ = lq.load(out)
    assert {m.scheme.name for m in model.modules() if isinstance(m, lq.QuantLinear)} == {"w3a16"}


@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w4a16-g32-learned", "w3a16-g32-learned"])
def test_scale_search_on_a_grid_never_worsens_the_layer(scheme):
    weight, h = layer_and_inputs()
    s = lq.parse_scheme(scheme)
    scales = search_scales({"w": weight}, h, {"w": s}, grid=10)
    plain = output_error(weight, _rounded(weight, s), h)
    assert output_error(weight, _rounded(weight * scales, s) / scales, h) <= plain


def test_awq_and_rtn_on_a_grid_run_end_to_end(tiny_llama):
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(4))
    scheme = lq.parse_scheme("w4a16-g32-nf4")
    model = lq.quantize(copy.deepcopy(tiny_llama), [lq.AWQ(), lq.RTN()], scheme, calib=calib, progress=False)
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    assert layers and all(m.scheme.grid == "nf4" for m in layers)
