"""The sharded checkpoint a streamed quantization writes block by block: it loads, with exactly the tensors of the
same quantization done on the whole model and saved in one file, and memory never holds more than two blocks'
float weights while it is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import llmeasyquant as lq
from cli_helpers import assert_one_line_error, run
from conftest import save_hf_folders
from llmeasyquant.export.checkpoint import INDEX_FILE, WEIGHTS_FILE, load
from llmeasyquant.export.sharded import ShardedWriter, write_safetensors
from llmeasyquant.infra.files import staged_folder
from llmeasyquant.models.streaming import load_model_streamed

CALIB = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> dict[str, Path]:
    """Hugging Face folders in bf16 (as hub checkpoints are): llama with its own head, gpt2 with a tied one."""
    return save_hf_folders(tmp_path_factory.mktemp("sharded"), tiny_tokenizer, torch.bfloat16)


def _streamed_write(source: Path, out: Path, recipe: object, scheme: lq.QuantScheme, shard_bytes: int) -> int:
    """Quantize `source` streamed into a sharded checkpoint at `out`; the most float blocks held at once."""
    model, tokenizer, stream = load_model_streamed(source, hollow=True)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16  # kept as stored, not widened
    head = model.get_output_embeddings().weight
    assert head.is_meta != (head is model.get_input_embeddings().weight)  # an untied head is left unread
    with staged_folder(out) as tmp:
        writer = ShardedWriter(tmp, torch.float16, shard_bytes=shard_bytes)
        stream.sink = writer.add_block
        lq.quantize(model, recipe, scheme, calib=CALIB, progress=False, stream=stream)
        writer.finish(model, stream, tokenizer)
    assert stream.float_blocks() == 0  # every block went to disk and was released
    return stream.max_float_blocks


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_streamed_sharded_checkpoint_equals_whole_model_saved(folders, tmp_path: Path, kind: str,
                                                             method: str) -> None:
    recipe = lq.GPTQ() if method == "gptq" else lq.RTN()
    scheme = lq.parse_scheme("w4a16-g32-asym")
    whole, tokenizer = lq.load_model(str(folders[kind]))
    lq.quantize(whole, recipe, scheme, calib=CALIB, progress=False)
    lq.save(whole, tmp_path / "whole", tokenizer)
    held = _streamed_write(folders[kind], tmp_path / "streamed", recipe, scheme, shard_bytes=20_000)
    assert 1 <= held <= 2

    files = sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    index = json.loads((tmp_path / "streamed" / INDEX_FILE).read_text())
    assert len(files) > 2 and not (tmp_path / "streamed" / WEIGHTS_FILE).exists()
    assert files == sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for name in ("config.json", "quantization_config.json", "tokenizer.json"):
        assert (tmp_path / "streamed" / name).is_file()
    expected_q = json.loads((tmp_path / "whole" / "quantization_config.json").read_text())
    got_q = json.loads((tmp_path / "streamed" / "quantization_config.json").read_text())
    assert got_q == expected_q  # the tie, the layers, the recipe: all as the one-file save says

    expected, _ = load(tmp_path / "whole")
    got, got_tokenizer = load(tmp_path / "streamed")
    assert got_tokenizer is not None
    want, have = expected.state_dict(), got.state_dict()
    assert want.keys() == have.keys()
    assert all(want[k].dtype == have[k].dtype and torch.equal(want[k], have[k]) for k in want)
    assert torch.equal(expected(CALIB[:1]).logits, got(CALIB[:1]).logits)


def test_load_never_builds_the_float_model(folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader makes the model on the meta device: no float linear weight is ever allocated."""
    _streamed_write(folders["llama"], tmp_path / "q", lq.RTN(), lq.parse_scheme("w4a16-g32-asym"), 1 << 20)
    made: list[tuple[int, ...]] = []
    original = torch.nn.Linear.reset_parameters

    def spy(self: torch.nn.Linear) -> None:
        if not self.weight.is_meta:
            made.append(tuple(self.weight.shape))
        original(self)

    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", spy)
    model, _ = load(tmp_path / "q")
    assert made == []
    assert not any(t.is_meta for t in model.state_dict().values())


def test_cli_stream_writes_shards_and_refuses_an_existing_output(capsys, folders, tmp_path: Path) -> None:
    out = tmp_path / "q"
    code, printed, err = run(capsys, "quantize", folders["llama"], "--bits", "4", "--group-size", "32", "--stream",
                             "--estimate", "--out", out, "--json", tmp_path / "q.json")
    assert code == 0, err
    assert (out / INDEX_FILE).is_file() and "saved" in printed
    record = json.loads((tmp_path / "q.json").read_text())
    assert record["metrics"]["estimate_s"] > 0 and record["metrics"]["blocks"] == 2
    assert record["metrics"]["block_s_max"] >= record["metrics"]["block_s_median"] > 0
    before = sorted(p.name for p in out.iterdir())
    code, _, err = run(capsys, "quantize", folders["llama"], "--bits", "4", "--stream", "--out", out)
    assert_one_line_error(code, err, "exists already", "--force")
    assert sorted(p.name for p in out.iterdir()) == before
    code, _, err = run(capsys, "quantize", folders["llama"], "--bits", "4", "--stream", "--force", "--out", out)
    assert code == 0, err
    code, _, err = run(capsys, "eval", out, "--max-windows", "1", "--seqlen", "16")
    assert code == 0, err


def test_a_kv_cache_method_is_refused_when_streaming_to_disk(folders, tmp_path: Path) -> None:
    model, _, stream = load_model_streamed(folders["llama"], hollow=True)
    stream.sink = lambda _prefix, _block: None
    with pytest.raises(lq.ConfigError, match="without --stream"):
        lq.quantize(model, [lq.RTN(), lq.SimQuant()], lq.parse_scheme("w4a16-g32-asym"), calib=CALIB,
                    progress=False, stream=stream)


def test_write_safetensors_reads_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(3.0),
               "i8": torch.randint(-8, 7, (4, 3), dtype=torch.int8), "empty": torch.zeros(0, 4),
               "transposed": torch.randn(2, 3).t(), "i32": torch.randint(-2**31, 2**31 - 1, (5,), dtype=torch.int32)}
    write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
