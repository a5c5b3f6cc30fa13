"""benchmarks/make_synthetic.py: synthetic checkpoints of real shapes, tested on its tiny shapes.

The script reads the bundled SmolLM2 tokenizer, hence the slow marker.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tests.benchmark_helpers import load_benchmark
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow

TINY_SHAPES = ("llama-tiny", "qwen3-moe-tiny", "mixtral-tiny")
SHARD_GB = 0.004  # 4 MB: the tiny shapes split into several shards


@pytest.fixture(scope="module")
def synth() -> ModuleType:
    return load_benchmark("make_synthetic")


@pytest.fixture(scope="module")
def folders(synth: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synthetic")
    return {shape: synth.generate(shape, root / shape, seed=0, shard_gb=SHARD_GB) for shape in TINY_SHAPES}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_gives_byte_identical_files_whatever_the_sharding(synth, folders, tmp_path):
    again = synth.main(["--shape", "llama-tiny", "--out", str(tmp_path / "again"), "--shard-gb", str(SHARD_GB)])
    assert again == 0
    assert _files(tmp_path / "again") == _files(folders["llama-tiny"])
    # one shard instead of several: every tensor's bytes are the same
    synth.generate("llama-tiny", tmp_path / "one", seed=0, shard_gb=1.0)
    with safe_open(str(tmp_path / "one" / "model-00001-of-00001.safetensors"), "pt") as one:
        for name, file in json.loads((folders["llama-tiny"] / "model.safetensors.index.json").read_text())[
                "weight_map"].items():
            with safe_open(str(folders["llama-tiny"] / file), "pt") as sharded:
                assert torch.equal(one.get_tensor(name).view(torch.int16),
                                   sharded.get_tensor(name).view(torch.int16)), name


def test_another_seed_gives_other_weights(synth, folders, tmp_path):
    synth.generate("llama-tiny", tmp_path / "seed1", seed=1, shard_gb=1.0)
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(tmp_path / "seed1" / "model-00001-of-00001.safetensors"), "pt") as other:
        index = json.loads((folders["llama-tiny"] / "model.safetensors.index.json").read_text())
        with safe_open(str(folders["llama-tiny"] / index["weight_map"][name]), "pt") as first:
            assert not torch.equal(other.get_tensor(name), first.get_tensor(name))


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_index_and_shards_agree(synth, folders, shape):
    folder = folders[shape]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                       for i in range(1, len(shards) + 1)]
    held, total = {}, 0
    for shard in shards:
        with safe_open(str(shard), "pt") as handle:
            names = list(handle.keys())
            size = 0
            for name in names:
                tensor = handle.get_tensor(name)
                assert tensor.dtype == torch.bfloat16 and torch.isfinite(tensor).all(), name
                held[name] = shard.name
                size += 2 * tensor.numel()
        assert size <= SHARD_GB * 1e9 or len(names) == 1  # only a tensor larger than the limit stands alone
        total += size
    assert held == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    assert set(held) == {name for name, _ in synth.tensor_specs(json.loads((folder / "config.json").read_text()))}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_transformers_loads_every_tensor_without_a_warning_and_saves_the_same(folders, shape, tmp_path):
    handler = _Warnings()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folders[shape], output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert handler.messages == []
    # transformers writes back exactly the tensors read (the per-expert names of MoE checkpoints included)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "resaved")
    with safe_open(str(tmp_path / "resaved" / "model.safetensors"), "pt") as resaved:
        index = json.loads((folders[shape] / "model.safetensors.index.json").read_text())
        assert set(resaved.keys()) == set(index["weight_map"])
        for name, file in index["weight_map"].items():
            with safe_open(str(folders[shape] / file), "pt") as ours:
                assert torch.equal(resaved.get_tensor(name), ours.get_tensor(name)), name


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_forward_is_finite_with_unit_size_blocks_and_spread_logits(synth, folders, shape):
    stats = synth.check(folders[shape])
    assert stats["finite"]
    assert all(0.05 < rms < 5 for rms in stats["hidden_rms"]), stats["hidden_rms"]
    assert stats["logits_std"] > 0.5
    assert stats["distinct_top1"] > 1


def test_initialisation_follows_the_scaling_rules(synth):
    config = synth.shape_config("llama-3.2-1b")
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    assert synth.tensor_init("model.layers.3.input_layernorm.weight", (hidden,), config) == ("fill", 1.0)
    assert synth.tensor_init("model.layers.0.mlp.up_proj.weight", (8192, hidden), config) == (
        "normal", hidden ** -0.5)
    kind, std = synth.tensor_init("model.layers.0.mlp.down_proj.weight", (hidden, 8192), config)
    assert kind == "normal"
    assert std == pytest.approx(8192 ** -0.5 / math.sqrt(2 * layers))
    assert synth.tensor_init("model.embed_tokens.weight", (128256, hidden), config)[1] == hidden ** -0.25  # tied
    with pytest.raises(ValueError, match="no initialisation rule"):
        synth.tensor_init("model.conv.weight", (4, 4, 3), config)


def test_real_shapes_have_the_published_sizes(synth):
    """Parameter counts of the real architectures (Llama-3.2-1B: 1.236 B; Llama-3-8B: 8.030 B)."""
    def params(shape: str) -> int:
        return sum(math.prod(s) for _, s in synth.tensor_specs(synth.shape_config(shape)))

    assert round(params("llama-3.2-1b") / 1e6) == 1236
    assert round(params("llama-3-8b") / 1e6) == 8030


def test_an_existing_out_is_refused_without_force(synth, folders, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        synth.main(["--shape", "llama-tiny", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "--force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert synth.main(["--shape", "llama-tiny", "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".taken.partial-*"))


def test_layers_overrides_the_number_of_blocks(synth, tmp_path):
    synth.generate("qwen3-moe-tiny", tmp_path / "one", layers=1)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["num_hidden_layers"] == config["max_window_layers"] == 1
    index = json.loads((tmp_path / "one" / "model.safetensors.index.json").read_text())
    assert {name.split(".")[2] for name in index["weight_map"] if name.startswith("model.layers.")} == {"0"}


def test_the_toolkit_loads_and_streams_it(folders):
    from llmeasyquant import load_model
    from llmeasyquant.models.streaming import load_model_streamed

    model, tokenizer = load_model(str(folders["llama-tiny"]))
    ids = tokenizer("a synthetic model", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(ids).logits
    streamed, _, streamer = load_model_streamed(folders["llama-tiny"])
    for block in range(streamed.config.num_hidden_layers):
        streamer.load_block(block)
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, expected)


def test_the_cli_quantizes_it_with_rtn_streamed_or_not(folders, tmp_path, capsys):
    from cli_helpers import run

    outs = {}
    for mode in ("plain", "stream"):
        outs[mode] = tmp_path / mode
        extra = ["--stream"] if mode == "stream" else []
        code, _, err = run(capsys, "quantize", folders["llama-tiny"], "--bits", "4", "--group-size", "32", *extra,
                           "--out", outs[mode])
        assert code == 0, err
    # The streamed write is sharded (model-0000k-of-0000n.safetensors), the in-memory one a single file.
    plain, streamed = ({k: v for f in sorted(outs[mode].glob("*.safetensors")) for k, v in load_file(f).items()}
                       for mode in ("plain", "stream"))
    assert set(plain) == set(streamed)
    assert sum(name.endswith(".qweight") for name in plain) == 7 * 2  # 7 linears a block
    for name, tensor in plain.items():
        assert torch.equal(tensor, streamed[name]), name
