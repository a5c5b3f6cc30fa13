"""--lm-head: the LM head quantized too (weight-only or dynamic activations), a tied head with its own integer copy."""

from __future__ import annotations

import torch

import llmeasyquant as lq
from llmeasyquant.cli import main
from llmeasyquant.kernels import native
from llmeasyquant.nn.qlinear import forced_kernel


def test_cli_quantizes_the_head_and_the_checkpoint_keeps_it(llama_folder, tmp_path, random_ids, capsys):
    out = tmp_path / "head"
    assert main(["--quiet", "quantize", str(llama_folder), "--lm-head", "w8a16", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert isinstance(model.lm_head, lq.QuantLinear) and model.lm_head.scheme == lq.W8A16
    assert model.lm_head.qweight.dtype == torch.int8
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)  # embeddings stay float for the lookup
    plain, _ = lq.load_model(str(llama_folder))
    with torch.no_grad():
        head_in = torch.randn(3, plain.config.hidden_size)
        expected = head_in @ plain.lm_head.weight.t()
        torch.testing.assert_close(model.lm_head(head_in), expected, rtol=0.05, atol=0.05)
    assert main(["--quiet", "quantize", str(llama_folder), "--lm-head", "w8a8-astatic", "--out",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "static activation scale" in err and "dynamic activations" in err
    assert not (tmp_path / "x").exists()


def test_cli_gives_the_head_dynamic_activations_on_an_integer_kernel(llama_folder, tmp_path, capsys):
    out = tmp_path / "head-w4a8"
    assert main(["--quiet", "quantize", str(llama_folder), "--bits", "4", "--group-size", "32", "--act-bits", "8",
                 "--lm-head", "w4a8-g32", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    head = model.lm_head
    assert isinstance(head, lq.QuantLinear) and head.scheme == lq.parse_scheme("w4a8-g32")
    plain, _ = lq.load_model(str(llama_folder))
    head_in = torch.randn(1, plain.config.hidden_size)
    with torch.no_grad():
        expected = head_in @ plain.lm_head.weight.t()
        found = head(head_in)
        with forced_kernel(head, "reference"):
            reference = head(head_in)
    if native.ops() is not None:  # the integer kernel runs the head
        assert head.kernel().name == "cpu_native_w4a8"
    torch.testing.assert_close(found, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(found, expected, rtol=0.15, atol=0.15)
