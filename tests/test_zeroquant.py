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


def test_lkd_lowers_block_error_at_w4a8(model_kind, make_model, calib, random_ids):
    base = make_model(model_kind)
    scheme = lq.parse_scheme("w4a8-g32")
    plain = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(lkd=False), scheme, calib=calib, progress=False)
    lkd = lq.quantize(copy.deepcopy(base), lq.ZeroQuant(steps=40, lr=1e-3), scheme, calib=calib, progress=False)
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


@pytest.mark.parametrize("options", [{"steps": -1}, {"lr": 0.0}])
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
