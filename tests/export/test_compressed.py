"""Export to compressed-tensors: the files hold our codes bit for bit, transformers loads them and runs them like
our reference kernel, and bad requests fail with a clear message."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import llmeasyquant as lq
from llmeasyquant.errors import ConfigError, OutputExistsError
from llmeasyquant.eval.export_check import check_export
from llmeasyquant.export.common import MissingRuntimeError
from llmeasyquant.export.compressed import export_compressed_tensors, open_transformers_runtime
from llmeasyquant.export.formats import export
from llmeasyquant.kernels import REFERENCE
from llmeasyquant.nn.qlinear import forced_kernel

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32


def _quantize(model: nn.Module, scheme: str | lq.Plan, calib: torch.Tensor | None = None) -> nn.Module:
    plan = lq.parse_scheme(scheme) if isinstance(scheme, str) else scheme
    return lq.quantize(model, lq.RTN(), plan, calib=calib, progress=False)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def _stored_codes(tensors: dict[str, torch.Tensor], name: str, bits: int) -> torch.Tensor:
    if f"{name}.weight_packed" in tensors:
        shape = tuple(tensors[f"{name}.weight_shape"].tolist())
        return unpack_from_int32(tensors[f"{name}.weight_packed"], bits, torch.Size(shape))
    return tensors[f"{name}.weight"]


def _reference_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), forced_kernel(model, REFERENCE.name):
        return model(ids, use_cache=False).logits[0]


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w4a16-g32", "w3a16-g32", "w8a16-g32"])
def test_files_hold_our_codes_and_transformers_runs_them(tiny_llama, tiny_tokenizer, random_ids, tmp_path: Path,
                                                         scheme: str) -> None:
    model = _quantize(tiny_llama, scheme)
    result = export_compressed_tensors(model, tiny_tokenizer, tmp_path / "ct")
    assert result.format == "compressed-tensors" and result.bytes > 0 and not result.requantized
    tensors = _tensors(result.path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)}
    assert sorted(result.lossless) == sorted(layers)
    for name, layer in layers.items():
        assert torch.equal(_stored_codes(tensors, name, layer.scheme.bits).to(torch.int8), layer.codes()), name
        assert torch.equal(tensors[f"{name}.weight_scale"].float(), layer.qparams().scale), name
    qconfig = json.loads((result.path / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors"
    group = next(iter(qconfig["config_groups"].values()))
    assert group["weights"]["num_bits"] == layers[next(iter(layers))].scheme.bits
    assert (group["input_activations"] is not None) == scheme.startswith("w8a8")
    assert (result.path / "tokenizer.json").is_file()

    runtime = open_transformers_runtime(result.path)
    got = runtime(random_ids[0])
    want = _reference_logits(model, random_ids[:1])
    if scheme.startswith("w8a8"):
        # compressed-tensors' dynamic int8 activations divide the range by 127.5 where we divide by 127.
        assert (got - want).abs().max() < 0.05 * want.abs().max()
    else:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_static_activation_scales_and_asymmetric_zeros_are_written(tiny_llama, random_ids, tmp_path: Path) -> None:
    model = _quantize(tiny_llama, "w8a8-astatic-aasym-asym", calib=random_ids)
    result = export_compressed_tensors(model, None, tmp_path / "ct")
    tensors = _tensors(result.path)
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)):
        assert torch.equal(tensors[f"{name}.input_scale"].float().reshape(1), layer.input_scale.float())
        assert torch.equal(tensors[f"{name}.weight"], layer.codes())
        assert torch.equal(tensors[f"{name}.weight_zero_point"].reshape(-1).to(torch.int32),
                           layer.qparams().zero.reshape(-1))
    group = next(iter(json.loads((result.path / "config.json").read_text())["quantization_config"]["config_groups"]
                      .values()))
    assert group["input_activations"]["dynamic"] is False


def test_mixed_precision_plan_gives_one_config_group_per_scheme(tiny_llama, tmp_path: Path) -> None:
    plan = lq.Plan([lq.Rule(r".*mlp.*", lq.parse_scheme("w4a16-g32")), lq.Rule(r".*", lq.parse_scheme("w8a16"))])
    model = _quantize(tiny_llama, plan)
    result = export_compressed_tensors(model, None, tmp_path / "ct")
    groups = json.loads((result.path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted(g["weights"]["num_bits"] for g in groups.values()) == [4, 8]
    targets = [t for g in groups.values() for t in g["targets"]]
    assert sorted(targets) == sorted(n for n, m in model.named_modules() if isinstance(m, lq.QuantLinear))


def test_refusals(make_model, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no quantized layers"):
        export_compressed_tensors(make_model("llama"), None, tmp_path / "a")
    with pytest.raises(ConfigError, match="multiple of its group size"):
        export_compressed_tensors(_quantize(make_model("llama"), "w4a16-g48"), None, tmp_path / "b")
    with pytest.raises(ConfigError, match=r"nn\.Linear"):
        export_compressed_tensors(_quantize(make_model("gpt2"), "w8a16"), None, tmp_path / "c")
    assert not list(tmp_path.iterdir()), "a refused export left files behind"


@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w4a16-g32-iq4nl", "w3a16-g32-learned"])
def test_grid_layers_are_refused_not_rewritten_as_uniform_codes(make_model, tmp_path: Path, scheme: str) -> None:
    """compressed-tensors would round table[code] x scale again onto uniform codes of that scale: other weights."""
    with pytest.raises(ConfigError, match=r"non-uniform .* grid.*export to gguf"):
        export_compressed_tensors(_quantize(make_model("llama"), scheme), None, tmp_path / "out")
    assert not list(tmp_path.iterdir()), "a refused export left files behind"


def test_existing_output_needs_force(tiny_llama, tmp_path: Path) -> None:
    model = _quantize(tiny_llama, "w8a16")
    out = tmp_path / "ct"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--force"):
        export_compressed_tensors(model, None, out)
    assert (out / "keep.txt").read_text() == "mine"
    export_compressed_tensors(model, None, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ct"], "temporary folders left behind"


def test_missing_library_names_the_install(monkeypatch, tiny_llama, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_ct(name, *args, **kwargs):
        if name.startswith("compressed_tensors"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ct)
    monkeypatch.setattr("importlib.import_module", lambda name: no_ct(name))
    with pytest.raises(MissingRuntimeError, match=r"pip install 'llmeasyquant\[export\]'"):
        export_compressed_tensors(_quantize(tiny_llama, "w8a16"), None, tmp_path / "ct")


def test_unknown_format_is_refused(tiny_llama, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown export format 'tflite'"):
        export(_quantize(tiny_llama, "w8a16"), "tflite", tmp_path / "x")


def test_check_compares_the_runtime_with_our_reference(tiny_llama, tiny_tokenizer, tmp_path: Path) -> None:
    from llmeasyquant.eval.perplexity import EvalWindows

    model = _quantize(tiny_llama, "w4a16-g32")
    result = export(model, "compressed-tensors", tmp_path / "ct", tokenizer=tiny_tokenizer)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    check = check_export(result.path, "compressed-tensors", model, EvalWindows(ids=ids, protocol={}), progress=False)
    assert check["windows"] == 2 and check["tokens"] == 46
    assert check["max_abs_logit_diff"] < 1e-4
    assert abs(check["ppl_rel_diff_pct"]) < 1e-3
