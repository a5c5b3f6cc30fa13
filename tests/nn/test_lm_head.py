"""--lm-head: the LM head quantized too (weight-only), a tied head getting its own integer copy."""

from __future__ import annotations

import torch

import llmeasyquant as lq
from llmeasyquant.cli import main


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
    assert main(["--quiet", "quantize", str(llama_folder), "--lm-head", "w8a8", "--out", str(tmp_path / "x")]) == 2
    assert "weight-only scheme" in capsys.readouterr().err
