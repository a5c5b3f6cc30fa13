"""GPTAQ: GPTQ fitted to the unquantized model's outputs (asymmetric calibration)."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.cli import main
from llmeasyquant.methods.gptaq import float_output_target


def test_the_target_is_the_float_weight_when_both_streams_read_the_same():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 24, generator=gen)
    weight = torch.randn(8, 24, generator=gen)
    target = float_output_target(weight, x.t() @ x, torch.zeros(24, 24), 0.01)
    assert torch.equal(target, weight)  # the dampening touches only the correction, here zero


def test_the_target_is_the_least_squares_weight_on_the_quantized_inputs():
    """Undamped, W* minimises ||X̃ W*ᵀ - X Wᵀ||: the residual is orthogonal to every column of X̃."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=gen)
    x_quantized = x + 0.1 * torch.randn(512, 16, generator=gen)
    weight = torch.randn(4, 16, generator=gen)
    target = float_output_target(weight, x_quantized.t() @ x_quantized, x_quantized.t() @ (x - x_quantized),
                                 0.0).double()
    residual = x_quantized.double() @ target.t() - x.double() @ weight.double().t()
    assert float((x_quantized.double().t() @ residual).abs().max()) < 1e-6 * float(residual.abs().max()) * 512


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_gptaq_follows_the_unquantized_model_closer_than_gptq_at_2_bits(kind, make_model, random_ids):
    base = make_model(kind)
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))
    scheme = lq.parse_scheme("w2a16-g32-asym")
    with torch.no_grad():
        reference = base(random_ids).logits
        errors = {}
        for method in (lq.GPTQ(), lq.GPTAQ()):
            model = lq.quantize(copy.deepcopy(base), method, scheme, calib=calib, progress=False)
            errors[method.name] = float((model(random_ids).logits - reference).pow(2).mean())
    assert errors["gptaq"] < 0.9 * errors["gptq"], errors
    again = lq.quantize(copy.deepcopy(base), lq.GPTAQ(), scheme, calib=calib, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                 strict=True))


def test_gptaq_refuses_a_mixture_of_experts():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", vocab_size=256, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(lq.ConfigError, match="router"):
        lq.quantize(model, lq.GPTAQ(), lq.W8A16, calib=torch.randint(0, 256, (4, 16)), progress=False)


def test_cli_gptaq_alone_after_a_rotation_and_streamed(llama_folder, wiki_text, tmp_path):
    calib = ["--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32"]
    for method, extra in (("gptaq", []), ("rotate+gptaq", []), ("gptaq", ["--stream"])):
        out = tmp_path / f"{method}{len(extra)}"
        assert main(["--quiet", "quantize", str(llama_folder), "--method", method, "--bits", "4", "--group-size",
                     "32", *calib, *extra, "--out", str(out)]) == 0
        model, _ = lq.load(out)
        assert model.llmeasyquant.recipe[-1]["method"] == "gptaq"
    streamed, _ = lq.load(tmp_path / "gptaq1")
    whole, _ = lq.load(tmp_path / "gptaq0")
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), streamed.state_dict().values(),
                                                 strict=True))


def test_gptaq_is_always_true_sequential():
    assert lq.GPTAQ().true_sequential is True
    with pytest.raises(lq.ConfigError, match="no-true-sequential"):
        lq.GPTAQ(true_sequential=False)
