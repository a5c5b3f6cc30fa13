"""Checkpoint save/load: exact round trips, storage types, atomic writes, and every way a checkpoint can be bad."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import llmeasyquant as lq
from llmeasyquant.export.checkpoint import QCONFIG_FILE, WEIGHTS_FILE, bits_per_weight, checkpoint_bytes
from llmeasyquant.nn.qlinear import quantized_layers


def _quantize(model: nn.Module, scheme: str, **kw) -> nn.Module:
    return lq.quantize(model, lq.RTN(), lq.parse_scheme(scheme), progress=False, **kw)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _tensor_dtypes(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        return {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


# round trips -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_fp32", [False, True])
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w4a16-g32-asym", "w3a16-g48", "w2a16-g32-asym"])
def test_round_trip_gives_exactly_the_same_logits(make_model, model_kind: str, scheme: str, keep_fp32: bool,
                                                  tiny_tokenizer, random_ids: torch.Tensor, tmp_path: Path) -> None:
    model = _quantize(make_model(model_kind), scheme, keep_fp32=keep_fp32)
    before = _logits(model, random_ids)
    folder = lq.save(model, tmp_path / "ckpt", tiny_tokenizer)
    assert folder == tmp_path / "ckpt"
    loaded, tokenizer = lq.load(folder)
    assert torch.equal(_logits(loaded, random_ids), before)
    # Same layers, same integers.
    ours = {n: m for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)}
    theirs = {n: m for n, m in loaded.named_modules() if isinstance(m, lq.QuantLinear)}
    assert sorted(ours) == sorted(theirs)
    for name, layer in ours.items():
        assert theirs[name].scheme == layer.scheme
        assert torch.equal(theirs[name].qweight, layer.qweight)
        assert torch.equal(theirs[name].scales, layer.scales)
    assert loaded.llmeasyquant.float_dtype == ("float32" if keep_fp32 else "float16")
    assert loaded.llmeasyquant_source == model.llmeasyquant_source
    assert loaded.llmeasyquant.recipe == model.llmeasyquant.recipe
    assert loaded.llmeasyquant.plan == model.llmeasyquant.plan
    assert tokenizer is not None
    assert tokenizer("some text", add_special_tokens=False).input_ids == \
        tiny_tokenizer("some text", add_special_tokens=False).input_ids
    assert not loaded.training


def test_a_loaded_checkpoint_saves_and_loads_again(tiny_gpt2, random_ids: torch.Tensor, tmp_path: Path) -> None:
    model = _quantize(tiny_gpt2, "w4a16-g48-asym")
    lq.save(model, tmp_path / "first")
    again, _ = lq.load(tmp_path / "first")
    lq.save(again, tmp_path / "second")
    third, _ = lq.load(tmp_path / "second")
    assert torch.equal(_logits(third, random_ids), _logits(model, random_ids))
    assert load_file(tmp_path / "first" / WEIGHTS_FILE).keys() == load_file(tmp_path / "second" / WEIGHTS_FILE).keys()


@pytest.mark.parametrize("keep_fp32", [False, True])
def test_tied_embeddings_stay_tied_after_load(tiny_llama, keep_fp32: bool, tmp_path: Path) -> None:
    model = _quantize(tiny_llama, "w4a16-g32-asym", keep_fp32=keep_fp32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    lq.save(model, tmp_path / "ckpt")
    qconfig = json.loads((tmp_path / "ckpt" / QCONFIG_FILE).read_text())
    assert qconfig["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / WEIGHTS_FILE)  # stored once
    loaded, tokenizer = lq.load(tmp_path / "ckpt")
    assert tokenizer is None  # none was saved
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_quantized_lm_head_round_trip(tiny_llama, random_ids: torch.Tensor, tmp_path: Path) -> None:
    plan = lq.Plan((lq.Rule("lm_head", lq.W8A16), lq.Rule(".*", lq.W4A16_G64)))
    model = lq.quantize(tiny_llama, lq.RTN(), plan, progress=False)
    lq.save(model, tmp_path / "ckpt")
    loaded, _ = lq.load(tmp_path / "ckpt")
    assert isinstance(loaded.lm_head, lq.QuantLinear)
    assert torch.equal(_logits(loaded, random_ids), _logits(model, random_ids))


def test_a_loaded_model_holds_its_own_copy_of_the_weights(tiny_llama, random_ids: torch.Tensor,
                                                          tmp_path: Path) -> None:
    """safetensors maps the file; the loaded layers must not read the file's pages (decoding streams them every
    token, slower from the mapping): the model is unchanged when the file is overwritten in place."""
    lq.save(_quantize(tiny_llama, "w4a16-g64"), tmp_path / "ckpt")
    loaded, _ = lq.load(tmp_path / "ckpt")
    before = _logits(loaded, random_ids)
    weights = tmp_path / "ckpt" / WEIGHTS_FILE
    size = weights.stat().st_size
    with weights.open("r+b") as handle:  # in place: the same file, its pages changed
        handle.write(bytes(size))
    assert torch.equal(_logits(loaded, random_ids), before)


@pytest.mark.parametrize("keep_fp32, float_dtype", [(False, torch.float16), (True, torch.float32)])
def test_float_tensors_are_stored_in_the_chosen_width(tiny_gpt2, keep_fp32: bool, float_dtype: torch.dtype,
                                                      tmp_path: Path) -> None:
    model = _quantize(tiny_gpt2, "w4a16-g32-asym", keep_fp32=keep_fp32)
    lq.save(model, tmp_path / "ckpt")
    dtypes = _tensor_dtypes(tmp_path / "ckpt")
    qconfig = json.loads((tmp_path / "ckpt" / QCONFIG_FILE).read_text())
    assert qconfig["float_dtype"] == ("float32" if keep_fp32 else "float16")
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                 "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.bias"):
        assert dtypes[name] == float_dtype, name
    for name, dtype in dtypes.items():
        if name.endswith(".qweight"):
            assert dtype == torch.uint8, name  # 4-bit codes, two per byte
        elif name.endswith(".zeros"):
            assert dtype == torch.int8, name
        elif name.endswith(".scales"):
            assert dtype == torch.float16, name  # scales are always fp16
        else:
            assert dtype == float_dtype, name


def test_eight_bit_codes_are_stored_as_int8(tiny_llama, tmp_path: Path) -> None:
    lq.save(_quantize(tiny_llama, "w8a16"), tmp_path / "ckpt")
    dtypes = _tensor_dtypes(tmp_path / "ckpt")
    assert dtypes["model.layers.0.self_attn.q_proj.qweight"] == torch.int8
    assert "model.layers.0.self_attn.q_proj.zeros" not in dtypes  # symmetric: no zero points


def test_checkpoint_files_and_quantization_config(tiny_llama, tiny_tokenizer, tmp_path: Path) -> None:
    model = _quantize(tiny_llama, "w4a16-g32-asym")
    folder = lq.save(model, tmp_path / "ckpt", tiny_tokenizer)
    names = set(os.listdir(folder))
    assert {WEIGHTS_FILE, "config.json", QCONFIG_FILE, "tokenizer.json", "tokenizer_config.json"} <= names
    qconfig = json.loads((folder / QCONFIG_FILE).read_text())
    assert qconfig["format"] == "llmeasyquant" and qconfig["format_version"] == 1
    assert qconfig["source_model"] == "tiny-random-llama"
    assert qconfig["recipe"] == [{"method": "rtn"}]
    assert len(qconfig["layers"]) == 14
    assert qconfig["layers"]["model.layers.1.mlp.down_proj"] == {
        "bits": 4, "symmetric": False, "granularity": "group:32", "act": None}
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_no_temporary_folders_are_left(tiny_llama, tmp_path: Path) -> None:
    model = _quantize(tiny_llama, "w8a16")
    parent = tmp_path / "out"
    lq.save(model, parent / "ckpt")
    assert os.listdir(parent) == ["ckpt"]
    lq.save(model, parent / "ckpt", force=True)
    assert os.listdir(parent) == ["ckpt"]


def test_existing_output_needs_force(make_model, random_ids: torch.Tensor, tmp_path: Path) -> None:
    llama = _quantize(make_model("llama"), "w8a16")
    gpt2 = _quantize(make_model("gpt2"), "w4a16-g32-asym")
    out = tmp_path / "ckpt"
    lq.save(llama, out)
    with pytest.raises(lq.OutputExistsError, match="--force"):
        lq.save(gpt2, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"  # untouched
    lq.save(gpt2, out, force=True)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    loaded, _ = lq.load(out)
    assert torch.equal(_logits(loaded, random_ids), _logits(gpt2, random_ids))
    assert os.listdir(tmp_path) == ["ckpt"]


def test_force_over_an_existing_file_leaves_nothing_behind(tiny_llama, tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("an old file in the way")
    model = _quantize(tiny_llama, "w8a16")
    with pytest.raises(lq.OutputExistsError):
        lq.save(model, tmp_path / "ckpt")
    lq.save(model, tmp_path / "ckpt", force=True)
    assert (tmp_path / "ckpt" / WEIGHTS_FILE).is_file()
    assert os.listdir(tmp_path) == ["ckpt"]


def test_existing_empty_folder_also_needs_force(tiny_llama, tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    model = _quantize(tiny_llama, "w8a16")
    with pytest.raises(lq.OutputExistsError):
        lq.save(model, tmp_path / "ckpt")


def test_failed_save_leaves_nothing_behind_and_keeps_the_old_folder(tiny_llama, tmp_path: Path) -> None:
    class BrokenTokenizer:
        def save_pretrained(self, folder) -> None:
            raise RuntimeError("disk full")

    model = _quantize(tiny_llama, "w8a16")
    with pytest.raises(RuntimeError, match="disk full"):
        lq.save(model, tmp_path / "new", BrokenTokenizer())
    assert os.listdir(tmp_path) == []
    lq.save(model, tmp_path / "old")
    with pytest.raises(RuntimeError, match="disk full"):
        lq.save(model, tmp_path / "old", BrokenTokenizer(), force=True)
    assert os.listdir(tmp_path) == ["old"]
    lq.load(tmp_path / "old")  # still a good checkpoint


def test_saving_an_unquantized_model_is_a_config_error(tiny_llama, tmp_path: Path) -> None:
    with pytest.raises(lq.ConfigError, match="not quantized"):
        lq.save(tiny_llama, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_tensor_too_large_for_fp16_survives_the_round_trip(tiny_llama, random_ids: torch.Tensor,
                                                           tmp_path: Path) -> None:
    with torch.no_grad():
        tiny_llama.model.layers[0].input_layernorm.weight[0] = 1e6  # beyond fp16's 65504
    model = _quantize(tiny_llama, "w8a16")
    # Kept in fp32 in memory, as round_unquantized_to_fp16 documents.
    assert float(model.model.layers[0].input_layernorm.weight.detach()[0]) == 1e6
    lq.save(model, tmp_path / "ckpt")
    loaded, _ = lq.load(tmp_path / "ckpt")
    assert float(loaded.model.layers[0].input_layernorm.weight.detach()[0]) == 1e6
    assert torch.equal(_logits(loaded, random_ids), _logits(model, random_ids))


# sizes -------------------------------------------------------------------------------------------------------


def _expected_bits(model: nn.Module, code_bits: int, per_group_bits: int) -> float:
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    weights = sum(m.in_features * m.out_features for m in layers)
    groups = sum(m.out_features * -(-m.in_features // m.group_size) for m in layers)
    return (code_bits * weights + per_group_bits * groups) / weights


@pytest.mark.parametrize("scheme, code_bits, per_group_bits, low, high", [
    ("w8a16", 8, 16, 8.0, 8.5),
    ("w8a8", 8, 16, 8.0, 8.5),
    ("w4a16-g32-asym", 4, 24, 4.75, 4.75),  # 4 + (16 + 8) / 32 exactly: every width divides by 32
    ("w4a16-g32", 4, 16, 4.5, 4.5),
    ("w2a16-g32-asym", 2, 24, 2.75, 2.75),  # 2-bit codes packed four per byte
    ("w3a16-g32", 3, 16, 3.5, 3.5),  # 3-bit codes packed eight per three bytes
    ("w4a16-g48-asym", 4, 24, 4.5, 5.0),  # partial last groups
])
def test_bits_per_weight(make_model, model_kind: str, scheme: str, code_bits: int, per_group_bits: int,
                         low: float, high: float) -> None:
    model = _quantize(make_model(model_kind), scheme)
    bpw = bits_per_weight(model)
    assert bpw == pytest.approx(_expected_bits(model, code_bits, per_group_bits), rel=1e-12)
    assert low <= bpw <= high


def test_bits_per_weight_of_an_unquantized_model_is_nan(tiny_llama) -> None:
    assert bits_per_weight(tiny_llama) != bits_per_weight(tiny_llama)


def test_checkpoint_bytes_counts_every_file(make_model, model_kind: str, tiny_tokenizer, tmp_path: Path) -> None:
    base = make_model(model_kind)
    fp32_bytes = 4 * sum(p.numel() for p in base.parameters())  # tied tensors counted once by parameters()
    sizes = {}
    for scheme in ("w8a16", "w4a16-g32-asym"):
        folder = lq.save(_quantize(copy.deepcopy(base), scheme), tmp_path / scheme, tiny_tokenizer)
        total = checkpoint_bytes(folder)
        assert total == sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        weights = (folder / WEIGHTS_FILE).stat().st_size
        assert total > weights
        assert weights < fp32_bytes / 2  # fp16 floats and int codes: less than half of fp32
        sizes[scheme] = weights
    assert sizes["w4a16-g32-asym"] < sizes["w8a16"]


# bad checkpoints ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory, make_model) -> Path:
    folder = tmp_path_factory.mktemp("good") / "ckpt"
    lq.save(_quantize(make_model("llama"), "w4a16-g32-asym"), folder)
    return folder


@pytest.fixture
def ckpt(good_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of a good checkpoint, for a test to damage."""
    return Path(shutil.copytree(good_checkpoint, tmp_path / "ckpt"))


def test_the_good_checkpoint_loads(ckpt: Path) -> None:
    model, _ = lq.load(ckpt)
    assert sum(isinstance(m, lq.QuantLinear) for m in model.modules()) == 14


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(lq.CheckpointError, match="no checkpoint folder"):
        lq.load(tmp_path / "nowhere")


def test_folder_without_quantization_config(ckpt: Path) -> None:
    (ckpt / QCONFIG_FILE).unlink()
    with pytest.raises(lq.CheckpointError, match=re.escape(f"no {QCONFIG_FILE}")):
        lq.load(ckpt)


def test_plain_model_folder_is_not_a_checkpoint(llama_folder: Path) -> None:
    with pytest.raises(lq.CheckpointError, match="not an llmeasyquant checkpoint"):
        lq.load(llama_folder)


def test_corrupt_quantization_config(ckpt: Path) -> None:
    (ckpt / QCONFIG_FILE).write_text('{"format": "llmeasyquant", "layers": {')
    with pytest.raises(lq.CheckpointError, match="not valid JSON"):
        lq.load(ckpt)


def test_quantization_config_of_another_format(ckpt: Path) -> None:
    qconfig = json.loads((ckpt / QCONFIG_FILE).read_text())
    qconfig["format_version"] = 99
    (ckpt / QCONFIG_FILE).write_text(json.dumps(qconfig))
    with pytest.raises(lq.CheckpointError, match="not format llmeasyquant v1"):
        lq.load(ckpt)


def test_quantization_config_with_a_bad_scheme(ckpt: Path) -> None:
    qconfig = json.loads((ckpt / QCONFIG_FILE).read_text())
    qconfig["layers"]["model.layers.0.mlp.up_proj"]["bits"] = 5
    (ckpt / QCONFIG_FILE).write_text(json.dumps(qconfig))
    with pytest.raises(lq.CheckpointError, match="unreadable configuration"):
        lq.load(ckpt)


def test_corrupt_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{ not json")
    with pytest.raises(lq.CheckpointError, match="unreadable configuration"):
        lq.load(ckpt)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(ckpt: Path, damage: str) -> None:
    path = ckpt / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x93NUMPY not a safetensors file" * 20, "truncated": data[: len(data) // 2],
                      "empty": b""}[damage])
    with pytest.raises(lq.CheckpointError, match=re.escape(f"{WEIGHTS_FILE} is corrupt")):
        lq.load(ckpt)


def test_missing_safetensors(ckpt: Path) -> None:
    (ckpt / WEIGHTS_FILE).unlink()
    with pytest.raises(lq.CheckpointError, match=re.escape(f"no {WEIGHTS_FILE}")):
        lq.load(ckpt)


def _rewrite_tensors(ckpt: Path, change) -> None:
    tensors = load_file(ckpt / WEIGHTS_FILE)
    change(tensors)
    save_file(tensors, ckpt / WEIGHTS_FILE, metadata={"format": "pt"})


def test_tensor_removed(ckpt: Path) -> None:
    _rewrite_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.q_proj.qweight"))
    with pytest.raises(lq.CheckpointError, match=r"missing \['model\.layers\.1\.self_attn\.q_proj\.qweight'\]"):
        lq.load(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    _rewrite_tensors(ckpt, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    with pytest.raises(lq.CheckpointError, match=r"unexpected \['model\.extra\.weight'\]"):
        lq.load(ckpt)


@pytest.mark.parametrize("name, make_bad", [
    ("model.layers.0.mlp.down_proj.scales", lambda t: t[:, :-1].contiguous()),  # wrong shape
    ("model.layers.0.mlp.down_proj.qweight", lambda t: t[:-1].contiguous()),  # wrong shape
    ("model.norm.weight", lambda t: torch.cat([t, t])),  # wrong shape, a float tensor
    ("model.layers.0.mlp.down_proj.qweight", lambda t: t.to(torch.int8)),  # wrong integer type
    ("model.layers.0.mlp.down_proj.zeros", lambda t: t.float()),  # float where integers belong
])
def test_tensor_with_wrong_shape_or_type(ckpt: Path, name: str, make_bad) -> None:
    _rewrite_tensors(ckpt, lambda t: t.update({name: make_bad(t[name])}))
    with pytest.raises(lq.CheckpointError, match=r"mismatched \[.*" + name.replace(".", r"\.")) as info:
        lq.load(ckpt)
    assert "does not match its configuration" in str(info.value)


def test_quantization_config_naming_a_missing_layer(ckpt: Path) -> None:
    qconfig = json.loads((ckpt / QCONFIG_FILE).read_text())
    qconfig["layers"]["model.layers.7.mlp.down_proj"] = qconfig["layers"]["model.layers.0.mlp.down_proj"]
    (ckpt / QCONFIG_FILE).write_text(json.dumps(qconfig))
    with pytest.raises(lq.CheckpointError, match=r"names layer 'model\.layers\.7\.mlp\.down_proj'"):
        lq.load(ckpt)


def test_quantization_config_naming_a_module_that_is_not_linear(ckpt: Path) -> None:
    qconfig = json.loads((ckpt / QCONFIG_FILE).read_text())
    qconfig["layers"]["model.layers.0.mlp.act_fn"] = qconfig["layers"]["model.layers.0.mlp.down_proj"]
    (ckpt / QCONFIG_FILE).write_text(json.dumps(qconfig))
    with pytest.raises(lq.CheckpointError, match=r"model\.layers\.0\.mlp\.act_fn"):
        lq.load(ckpt)


# non-uniform grids ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w4a16-g32-iq4nl", "w4a16-g32-learned", "w3a16-g32-learned"])
def test_grid_round_trip_gives_exactly_the_same_logits(tiny_llama, random_ids: torch.Tensor, tmp_path: Path,
                                                       scheme: str) -> None:
    model = _quantize(tiny_llama, scheme)
    before = _logits(model, random_ids)
    loaded, _ = lq.load(lq.save(model, tmp_path / "ckpt"))
    assert torch.equal(_logits(loaded, random_ids), before)
    for name, layer in quantized_layers(model).items():
        theirs = quantized_layers(loaded)[name]
        assert theirs.scheme == layer.scheme and theirs.scheme.grid == scheme.rsplit("-", 1)[1]
        assert torch.equal(theirs.dequantize(), layer.dequantize())
        if layer.levels is not None:
            assert theirs.levels.dtype == torch.float16 and torch.equal(theirs.levels, layer.levels)


@pytest.mark.parametrize("bits", [3, 4])
def test_learned_grid_tables_count_in_bits_per_weight(tiny_llama, bits: int) -> None:
    model = _quantize(copy.deepcopy(tiny_llama), f"w{bits}a16-g32-learned")
    layers = quantized_layers(model).values()
    weights = sum(m.in_features * m.out_features for m in layers)
    tables = sum(m.out_features * 2**bits * 16 for m in layers)  # 2^bits fp16 levels a row
    assert bits_per_weight(model) == pytest.approx(bits + 0.5 + tables / weights, rel=1e-12)
    assert bits_per_weight(_quantize(copy.deepcopy(tiny_llama), "w4a16-g32-nf4")) == pytest.approx(4.5)
