"""Block streaming: a model whose blocks are read from safetensors one at a time quantizes to exactly the weights
of the model loaded whole, while never holding more than two blocks' float weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.models.test_arch import FAMILIES, tiny

import llmeasyquant as lq
from cli_helpers import assert_one_line_error, run
from conftest import build_model, save_hf_folders
from llmeasyquant.models.arch import ARCHITECTURES
from llmeasyquant.models.streaming import load_model_streamed


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> dict[str, Path]:
    return save_hf_folders(tmp_path_factory.mktemp("stream"), tiny_tokenizer)


def _quantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith(("qweight", "scales", "zeros"))}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_streamed_quantization_equals_whole_model(folders, kind: str, method: str) -> None:
    calib = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    recipe = lq.GPTQ() if method == "gptq" else lq.RTN()
    scheme = lq.parse_scheme("w4a16-g32-asym")
    whole, _ = lq.load_model(str(folders[kind]))
    lq.quantize(whole, recipe, scheme, calib=calib, progress=False)
    streamed, _, streamer = load_model_streamed(folders[kind])
    assert streamer.float_blocks() == 0  # nothing of the blocks read yet
    lq.quantize(streamed, recipe, scheme, calib=calib, progress=False, stream=streamer)
    assert 1 <= streamer.max_float_blocks <= 2
    expected, got = _quantized(whole), _quantized(streamed)
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    ids = calib[:1]
    assert torch.allclose(whole(ids).logits, streamed(ids).logits, atol=1e-5)


def test_a_missing_tensor_is_a_clear_error(tiny_tokenizer, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    build_model("llama").save_pretrained(broken)
    tiny_tokenizer.save_pretrained(broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    _, _, streamer = load_model_streamed(broken)
    streamer.load_block(0)
    with pytest.raises(lq.ModelLoadError, match=r"lacks the tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        streamer.load_block(1)
    with pytest.raises(lq.ModelLoadError, match="not a Hugging Face model folder"):
        load_model_streamed(tmp_path)


def test_cli_stream(capsys, llama_folder: Path, tmp_path: Path) -> None:
    code, out, err = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--stream",
                         "--out", tmp_path / "streamed")
    assert code == 0, err
    code, out_whole, err = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32",
                               "--out", tmp_path / "whole")
    assert code == 0, err
    assert out.split(": ", 1)[1].split(", quantized")[0] == out_whole.split(": ", 1)[1].split(", quantized")[0]
    code, _, err = run(capsys, "quantize", llama_folder, "--method", "gptq", "--stream", "--calib", "self",
                       "--out", tmp_path / "self")
    assert_one_line_error(code, err, "--stream", "--calib PATH")


@pytest.mark.parametrize("family", [f for f in FAMILIES if ARCHITECTURES[f].experts is None])
def test_every_family_streams_to_the_codes_of_the_in_memory_run(family, tmp_path, tiny_tokenizer):
    """Block streaming reads each family's files (GPT-NeoX's head is stored as `embed_out`: the table's
    `stored_names`) and gives the codes quantizing in memory gives."""
    folder = tmp_path / family
    tiny(family).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    calib = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = lq.quantize(tiny(family), lq.GPTQ(), lq.W8A16, calib=calib, progress=False)
    model, _, streamer = load_model_streamed(folder)
    lq.quantize(model, lq.GPTQ(), lq.W8A16, calib=calib, progress=False, stream=streamer)
    found = model.state_dict()
    assert all(torch.equal(found[k], v) for k, v in expected.state_dict().items())


@pytest.mark.parametrize("family", [f for f in FAMILIES if ARCHITECTURES[f].experts is not None])
def test_a_mixture_of_experts_is_refused_by_streaming(family, tmp_path, tiny_tokenizer):
    """Streaming reads blocks by their float checkpoint names, which split experts do not have: a clear refusal."""
    folder = tmp_path / family
    tiny(family).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    model, _, streamer = load_model_streamed(folder)
    with pytest.raises(lq.ConfigError, match=f"{family}'s per-expert linears.*without --stream"):
        lq.quantize(model, lq.RTN(), lq.W8A16, progress=False, stream=streamer)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # own head, tied head
def test_a_hollow_models_embeddings_are_mapped_from_the_folder_and_remapped(folders, kind):
    from safetensors import safe_open

    model, _, stream = load_model_streamed(folders[kind], hollow=True)
    weight = model.get_input_embeddings().weight
    file = stream.files[stream.embeddings_name]
    with safe_open(str(file), "pt") as handle:
        stored = handle.get_tensor(stream.embeddings_name)
    assert torch.equal(weight, stored) and weight.dtype == stored.dtype
    assert weight.untyped_storage().nbytes() == file.stat().st_size  # a view into the whole file's map
    stream.map_embeddings()
    again = model.get_input_embeddings().weight
    assert again.data_ptr() != weight.data_ptr() and torch.equal(again, stored)
    if kind == "gpt2":
        assert model.get_output_embeddings().weight is again  # still tied
