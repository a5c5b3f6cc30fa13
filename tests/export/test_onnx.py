"""ONNX export: a QDQ graph holding our exact integer codes, run by ONNX Runtime to the reference kernel's logits."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import llmeasyquant as lq
from llmeasyquant.export.common import ExportResult, MissingRuntimeError
from llmeasyquant.export.onnx import DATA_FILE, MODEL_FILE, export_onnx, open_onnx_runtime
from llmeasyquant.export.onnx_graph import LayerCodes, OnnxExportError, rewrite
from llmeasyquant.kernels import REFERENCE
from llmeasyquant.nn.qlinear import forced_kernel

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

# Each export (a few seconds) is shared by this module's tests and holds two schemes: one in the attention
# projections, one in the MLP, so that four llama exports cover W8A8 dynamic and static, W8A16 per channel and
# grouped, W4A16 g32 asymmetric, 3-bit (a group width of 48 leaves a shorter last group) and W4A8 grouped.
LLAMA_PAIRS = [("w8a8", "w8a16"), ("w8a8-astatic", "w8a16-g16"), ("w4a16-g32-asym", "w3a16-g48-asym"),
               ("w4a8-g32", "w4a8-g16-asym")]
# GPT-2 (QuantLinear in place of Conv1D) with a different scheme in each of its four linear layers: asymmetric
# dynamic per-token, dynamic per-tensor and asymmetric static activations, 3-bit weights.
GPT2_SCHEMES = {r".*\.c_attn": "w8a8-aasym", r".*\.attn\.c_proj": "w8a8-apt", r".*\.c_fc": "w8a8-astatic-aasym",
                r".*\.mlp\.c_proj": "w3a16-g16"}
GPT2_PLAN = lq.Plan(tuple(lq.Rule(pattern, lq.parse_scheme(name)) for pattern, name in GPT2_SCHEMES.items()))
# Of the largest logit; measured here ~2e-7 (float summation order). Quantized activations get more room: another
# CPU's kernels may differ in the last bit before a rounding step and flip a code.
WEIGHT_ONLY_TOLERANCE = 1e-3
ACT_TOLERANCE = 2e-2


@dataclass
class Exported:
    model: nn.Module
    before: dict[str, torch.Tensor]  # the model's state before the export
    result: ExportResult
    graph: onnx.ModelProto

    @property
    def layers(self) -> dict[str, lq.QuantLinear]:
        return {n: m for n, m in self.model.named_modules() if isinstance(m, lq.QuantLinear)}


def _calib() -> torch.Tensor:
    return torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(11))


def _quantize(model: nn.Module, plan: lq.Plan | lq.QuantScheme) -> nn.Module:
    static = any(r.scheme.static_act for r in plan.rules) if isinstance(plan, lq.Plan) else plan.static_act
    return lq.quantize(model, lq.RTN(), plan, calib=_calib() if static else None, progress=False)


def _export(model: nn.Module, tokenizer, out: Path, **kwargs) -> Exported:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = export_onnx(model, tokenizer, out, **kwargs)
    return Exported(model, before, result, onnx.load(str(out / MODEL_FILE)))


@pytest.fixture(scope="module", params=LLAMA_PAIRS, ids="+".join)
def llama_export(request, make_model, tiny_tokenizer, tmp_path_factory) -> Exported:
    attention, mlp = (lq.parse_scheme(name) for name in request.param)
    plan = lq.Plan((lq.Rule(r".*\.self_attn\..*", attention), lq.Rule(r".*\.mlp\..*", mlp)))
    return _export(_quantize(make_model("llama"), plan), tiny_tokenizer, tmp_path_factory.mktemp("onnx") / "out")


@pytest.fixture(scope="module")
def gpt2_export(make_model, tmp_path_factory) -> Exported:
    """Written over an existing folder (force) with its weights in an external data file."""
    out = tmp_path_factory.mktemp("onnx") / "gpt2"
    out.mkdir()
    return _export(_quantize(make_model("gpt2"), GPT2_PLAN), None, out, force=True, external_data=True)


def _initializers(graph: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in graph.graph.initializer}


def _check_graph(exp: Exported) -> None:
    """Every quantized layer is integer codes (bit for bit ours) + scales + zero points behind a DequantizeLinear,
    its activations (W8A8) go through QuantizeLinear, and no float copy of a quantized weight is left."""
    tensors = _initializers(exp.graph)
    types = {i.name: i.data_type for i in exp.graph.graph.initializer}
    nodes = {n.output[0]: n for n in exp.graph.graph.node}
    ops = {n.op_type for n in exp.graph.graph.node}
    for name, layer in exp.layers.items():
        assert name + ".weight_t" not in tensors
        expected_type = onnx.TensorProto.INT4 if layer.scheme.bits == 4 else onnx.TensorProto.INT8
        assert types[name + ".qweight"] == expected_type
        np.testing.assert_array_equal(tensors[name + ".qweight"].astype(np.int8), layer.codes().t().numpy())
        qp = layer.qparams()
        per_channel = qp.scale.shape[1] == 1
        scale = qp.scale[:, 0] if per_channel else qp.scale.t()
        np.testing.assert_array_equal(tensors[name + ".scale"], scale.numpy())
        if qp.zero is None:
            assert name + ".zero_point" not in tensors
        else:
            zero = qp.zero[:, 0] if per_channel else qp.zero.t()
            np.testing.assert_array_equal(tensors[name + ".zero_point"].astype(np.int32), zero.numpy())
        dq = nodes[name + ".weight_t"]
        assert dq.op_type == "DequantizeLinear" and dq.input[0] == name + ".qweight"
        attrs = {a.name: a.i for a in dq.attribute}
        assert attrs == ({"axis": 1} if per_channel else {"axis": 0, "block_size": qp.group_size})
        act = layer.scheme.act
        assert (name + ".input.quantize" in nodes) == (act is not None)
        if act is not None and act.mode is not lq.ActMode.DYNAMIC:
            assert float(tensors[name + ".input_scale"]) == float(layer.input_scale)
    has_act = any(layer.scheme.act is not None for layer in exp.layers.values())
    assert "DequantizeLinear" in ops and ("QuantizeLinear" in ops) == has_act
    # Float constants besides the layers' scales: the unquantized parameters (tied ones once) and small constants,
    # less than one quantized weight more.
    floats = sum(t.size for n, t in tensors.items() if t.dtype == np.float32 and not n.endswith(".scale"))
    unquantized = sum(p.numel() for n, p in exp.model.named_parameters() if ".".join(n.split(".")[:-1])
                      not in exp.layers)
    assert floats < unquantized + min(layer.codes().numel() for layer in exp.layers.values())


def _check_logits(exp: Exported, ids: torch.Tensor, folder: Path | None = None) -> float:
    """ONNX Runtime's logits against the reference kernel's (the arithmetic the graph follows), per sequence."""
    runtime = open_onnx_runtime(folder or exp.result.path, threads=2)
    tolerance = ACT_TOLERANCE if any(m.scheme.act for m in exp.layers.values()) else WEIGHT_ONLY_TOLERANCE
    worst = 0.0
    for row in ids:
        with torch.no_grad(), forced_kernel(exp.model, REFERENCE.name):
            ours = exp.model(row[None], use_cache=False).logits[0]
        theirs = runtime(row)
        assert theirs.shape == ours.shape and theirs.dtype == torch.float32
        diff = float((theirs - ours).abs().max())
        assert diff <= tolerance * float(ours.abs().max()), diff
        worst = max(worst, diff)
        with torch.no_grad():  # the fast CPU kernels round differently (bf16 activations for weight-only layers)
            fast = exp.model(row[None], use_cache=False).logits[0]
        assert float((theirs - fast).abs().max()) <= 5e-2 * float(fast.abs().max())
    return worst


def test_graph_holds_our_exact_codes(llama_export: Exported) -> None:
    _check_graph(llama_export)


def test_onnxruntime_gives_the_reference_logits(llama_export: Exported, random_ids: torch.Tensor) -> None:
    worst = _check_logits(llama_export, random_ids[:2])
    schemes = sorted({layer.scheme.name for layer in llama_export.layers.values()})
    assert len(schemes) == 2
    print(f"\nllama {'+'.join(schemes)}: max abs logit difference {worst:.3g}")


def test_written_folder_and_result(llama_export: Exported) -> None:
    result = llama_export.result
    files = {p.name for p in result.path.iterdir()}
    assert {MODEL_FILE, "config.json", "tokenizer.json"} <= files and DATA_FILE not in files
    onnx.checker.check_model(str(result.path / MODEL_FILE))
    assert result.format == "onnx" and result.seconds > 0 and result.bytes > 0
    assert result.lossless == list(llama_export.layers) and result.requantized == []
    assert any("onnxruntime check" in note for note in result.notes)
    assert result.to_dict()["lossless_layers"] == len(llama_export.layers)


def test_the_callers_model_is_unchanged(llama_export: Exported) -> None:
    after = llama_export.model.state_dict()
    assert after.keys() == llama_export.before.keys()
    assert all(torch.equal(after[k], v) for k, v in llama_export.before.items())
    assert all(layer.kernel_name is None for layer in llama_export.layers.values())


def test_gpt2_with_a_scheme_per_layer(gpt2_export: Exported, random_ids: torch.Tensor) -> None:
    assert {layer.scheme.name for layer in gpt2_export.layers.values()} == set(GPT2_SCHEMES.values())
    _check_graph(gpt2_export)  # onnx.load read the external data back
    worst = _check_logits(gpt2_export, random_ids[:2], folder=gpt2_export.result.path / MODEL_FILE)
    print(f"\ngpt2 mixed plan: max abs logit difference {worst:.3g}")


def test_external_data_file(gpt2_export: Exported) -> None:
    out = gpt2_export.result.path
    assert (out / DATA_FILE).is_file() and (out / "config.json").is_file() and not (out / "tokenizer.json").exists()
    stored = onnx.load(str(out / MODEL_FILE), load_external_data=False).graph.initializer
    assert all(i.data_location == onnx.TensorProto.EXTERNAL for i in stored if i.name.endswith(".qweight"))
    assert "weights in model.onnx.data" in gpt2_export.result.notes
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_existing_output_needs_force(make_model, tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), lq.W8A16)
    (tmp_path / "out").mkdir()
    with pytest.raises(lq.OutputExistsError, match="--force"):
        export_onnx(model, None, tmp_path / "out")


def test_four_bit_activations_are_refused(make_model, tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), lq.parse_scheme("w4a4-g32"))
    with pytest.raises(lq.ConfigError, match=r"activations to 4 bits.*int8 only"):
        export_onnx(model, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w3a16-g32-learned"])
def test_grid_layers_are_refused(make_model, tmp_path: Path, scheme: str) -> None:
    """DequantizeLinear computes (code - zero) x scale: a grid's table[code] x scale has no ONNX form here."""
    model = _quantize(make_model("llama"), lq.parse_scheme(scheme))
    with pytest.raises(lq.ConfigError, match=r"non-uniform .* grid.*export to gguf"):
        export_onnx(model, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_model_that_is_not_quantized_is_refused(make_model, tmp_path: Path) -> None:
    with pytest.raises(lq.ConfigError, match="quantize it"):
        export_onnx(make_model("llama"), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_onnxruntime_names_the_install_command(make_model, tmp_path: Path, monkeypatch) -> None:
    model = _quantize(make_model("llama"), lq.W8A16)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(MissingRuntimeError, match=r"pip install 'llmeasyquant\[onnx\]'"):
        export_onnx(copy.deepcopy(model), None, tmp_path / "out")
    with pytest.raises(MissingRuntimeError, match="onnxruntime is not installed"):
        open_onnx_runtime(tmp_path)
    assert not (tmp_path / "out").exists()


def test_runtime_refuses_a_missing_file_and_batched_ids(gpt2_export: Exported, tmp_path: Path) -> None:
    with pytest.raises(lq.CheckpointError, match="no ONNX model"):
        open_onnx_runtime(tmp_path)
    with pytest.raises(lq.ConfigError, match=r"\[seqlen\]"):
        open_onnx_runtime(gpt2_export.result.path)(torch.zeros(1, 4, dtype=torch.int64))


def _matmul_graph(opset: int):
    """x [2, 4] @ lin.weight_t [4, 3] as an onnx_ir model."""
    helper = onnx.helper
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "lin.weight_t"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(np.zeros((4, 3), np.float32), "lin.weight_t")])
    return pytest.importorskip("onnx_ir").from_proto(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def test_the_rewrite_names_what_it_cannot_find() -> None:
    codes = LayerCodes(name="other", codes=np.zeros((3, 4), np.int8), scale=np.ones((3, 1), np.float32), zero=None,
                       group_size=4, bits=8, act=None)
    with pytest.raises(OnnxExportError, match=r"layer other has no weight other\.weight_t"):
        rewrite(_matmul_graph(21), [codes])
    with pytest.raises(OnnxExportError, match="needs opset 21"):
        rewrite(_matmul_graph(17), [codes])
