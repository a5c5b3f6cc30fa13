"""Rewrite an exported float graph into a QDQ graph: each quantized layer's float weight becomes integer codes, scales
and zero points feeding a DequantizeLinear, and W8A8 layers get QuantizeLinear/DequantizeLinear on their input.

The graph is an `onnx_ir.Model` (what torch.onnx returns), edited in place; it is never turned into one protobuf
message, so models past protobuf's 2 GB limit work. The arithmetic follows `kernels/reference.py` exactly:
weights (q - zero) * scale, activations rounded half to even on the grid of `primitives.choose_qparams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llmeasyquant.errors import LLMEasyQuantError
from llmeasyquant.export.common import require
from llmeasyquant.primitives import MIN_SCALE

if TYPE_CHECKING:
    import onnx_ir as ir

INSTALL = "pip install 'llmeasyquant[onnx]'"
# Initializer names, by layer name: the float stand-in's weight (its name ends up on the DequantizeLinear output),
# the integer codes [in, out], their scales and zero points, and the static activation scale and zero point.
WEIGHT_SUFFIX = ".weight_t"
CODES_SUFFIX = ".qweight"
SCALE_SUFFIX = ".scale"
ZERO_SUFFIX = ".zero_point"
INPUT_SCALE_SUFFIX = ".input_scale"
INPUT_ZERO_SUFFIX = ".input_zero"


class OnnxExportError(LLMEasyQuantError):
    """A model that torch.onnx could not trace, or a graph that does not have the shape the rewrite expects."""


@dataclass(frozen=True)
class ActQuant:
    """How a W8A8 layer quantizes its input: dynamic (per token or per tensor) or one static per-tensor scale."""

    dynamic: bool
    symmetric: bool
    per_token: bool
    scale: float | None = None  # static only
    zero: int = 0  # static asymmetric only


@dataclass(frozen=True)
class LayerCodes:
    """One quantized layer as plain arrays: int8 codes [out, in] (signed domain), fp32 scales [out, groups], int8
    zero points [out, groups] or None, the group width, the weight bit width and the activation side."""

    name: str
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    group_size: int
    bits: int
    act: ActQuant | None

    @property
    def code_type(self) -> str:
        """ONNX element type of the codes: int4 holds 4-bit codes; 2- and 3-bit codes widen to int8 (exact)."""
        return "INT4" if self.bits == 4 else "INT8"


def _ir() -> Any:
    return require("onnx_ir", INSTALL)


class _Builder:
    """Adds initializers and nodes to a graph; small constants shared by every layer are made once."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph, self.ir = graph, _ir()
        self._shared: dict[str, ir.Value] = {}
        # Positions of the traced nodes, taken once: graph.index walks the node list, quadratic over 200 layers.
        self.position = {node: i for i, node in enumerate(graph)}

    def const(self, name: str, array: np.ndarray, dtype: str | None = None) -> ir.Value:
        ir_ = self.ir
        if dtype == "INT4":  # numpy has no 4-bit type; ml_dtypes (an onnx_ir dependency) has
            array = array.astype(require("ml_dtypes", INSTALL).int4)
        tensor = ir_.tensor(np.array(array, order="C"), name=name)  # a C-order copy; scalars stay 0-d
        value = ir_.Value(name=name, const_value=tensor, type=ir_.TensorType(tensor.dtype), shape=tensor.shape)
        self.graph.register_initializer(value)
        return value

    def shared(self, name: str, array: np.ndarray) -> ir.Value:
        if name not in self._shared:
            self._shared[name] = self.const(f"llmeasyquant.{name}", array)
        return self._shared[name]

    def node(self, before: ir.Node, op: str, inputs: list, name: str, **attrs: Any) -> ir.Value:
        """Insert one node before `before` (keeps the node list in topological order); returns its output."""
        node = self.ir.node(op, inputs, attributes=attrs, name=name)
        node.outputs[0].name = name
        self.graph.insert_before(before, node)
        return node.outputs[0]


def _weight_dq(b: _Builder, layer: LayerCodes, first_use: ir.Node) -> ir.Value:
    """codes [in, out] + scale (+ zero) -> DequantizeLinear: per channel along axis 1, or blocked along axis 0."""
    per_channel = layer.scale.shape[1] == 1
    codes = b.const(layer.name + CODES_SUFFIX, layer.codes.T, layer.code_type)
    # [out, groups] -> [out] per channel, [groups, out] blocked: the scale follows the [in, out] code layout.
    scale = layer.scale[:, 0] if per_channel else layer.scale.T
    inputs = [codes, b.const(layer.name + SCALE_SUFFIX, scale.astype(np.float32))]
    if layer.zero is not None:
        zero = layer.zero[:, 0] if per_channel else layer.zero.T
        inputs.append(b.const(layer.name + ZERO_SUFFIX, zero, layer.code_type))
    attrs = {"axis": 1} if per_channel else {"axis": 0, "block_size": layer.group_size}
    return b.node(first_use, "DequantizeLinear", inputs, layer.name + ".dequantize_weight", **attrs)


def _dynamic_qparams(b: _Builder, x: ir.Value, act: ActQuant, at: ir.Node, prefix: str
                     ) -> tuple[ir.Value, ir.Value | None]:
    """Scale (and int8 zero point) of x computed in the graph, as choose_qparams does: the range widened to
    include zero, / 127 (symmetric) or / 255 with a zero point (asymmetric), clamped at 2**-24.
    Per token: reduced over the last axis, kept as [..., 1]; per tensor: a scalar."""
    reduce = {"keepdims": 1 if act.per_token else 0}
    axes = [b.shared("last_axis", np.array([-1], np.int64))] if act.per_token else []
    zero_f = b.shared("zero_f32", np.array(0.0, np.float32))
    eps = b.shared("min_scale", np.array(MIN_SCALE, np.float32))
    if act.symmetric:
        absx = b.node(at, "Abs", [x], prefix + ".abs")
        absmax = b.node(at, "ReduceMax", [absx, *axes], prefix + ".absmax", **reduce)
        raw = b.node(at, "Div", [absmax, b.shared("qmax_f32", np.array(127.0, np.float32))], prefix + ".scale_raw")
        return b.node(at, "Max", [raw, eps], prefix + ".scale"), None
    lo = b.node(at, "Min", [b.node(at, "ReduceMin", [x, *axes], prefix + ".min", **reduce), zero_f], prefix + ".lo")
    hi = b.node(at, "Max", [b.node(at, "ReduceMax", [x, *axes], prefix + ".max", **reduce), zero_f], prefix + ".hi")
    span = b.node(at, "Sub", [hi, lo], prefix + ".span")
    raw = b.node(at, "Div", [span, b.shared("levels_f32", np.array(255.0, np.float32))], prefix + ".scale_raw")
    scale = b.node(at, "Max", [raw, eps], prefix + ".scale")
    # zero = clamp(round(-128 - lo / scale), -128, 127): Round is half to even, like torch.round.
    shifted = b.node(at, "Sub", [b.shared("qmin_f32", np.array(-128.0, np.float32)),
                                 b.node(at, "Div", [lo, scale], prefix + ".lo_codes")], prefix + ".zero_raw")
    clipped = b.node(at, "Clip", [b.node(at, "Round", [shifted], prefix + ".zero_round"),
                                  b.shared("qmin_f32", np.array(-128.0, np.float32)),
                                  b.shared("qmax_f32", np.array(127.0, np.float32))], prefix + ".zero_clip")
    return scale, b.node(at, "Cast", [clipped], prefix + ".zero", to=b.ir.DataType.INT8)


def _activation_qdq(b: _Builder, layer: LayerCodes, matmul: ir.Node) -> None:
    """Put QuantizeLinear -> DequantizeLinear (int8) on the MatMul's input, the integer kernels' view of x."""
    act, x, prefix = layer.act, matmul.inputs[0], layer.name + ".input"
    if act.dynamic:
        scale, zero = _dynamic_qparams(b, x, act, matmul, prefix)
    else:
        scale = b.const(layer.name + INPUT_SCALE_SUFFIX, np.array(act.scale, np.float32))
        zero = b.const(layer.name + INPUT_ZERO_SUFFIX, np.array(act.zero, np.int8))
    # Per token the scale is [..., 1]: one block spanning the whole last axis. Per tensor it is a scalar.
    in_features = layer.codes.shape[1]
    attrs = {"axis": -1, "block_size": in_features} if act.dynamic and act.per_token else {}
    qargs = [x, scale] + ([zero] if zero is not None else [])
    qattrs = attrs if zero is not None else {**attrs, "output_dtype": b.ir.DataType.INT8}
    codes = b.node(matmul, "QuantizeLinear", qargs, prefix + ".quantize", **qattrs)
    matmul.replace_input_with(0, b.node(matmul, "DequantizeLinear", [codes, *qargs[1:]], prefix + ".dequantize",
                                        **attrs))


def _rewrite_layer(b: _Builder, layer: LayerCodes) -> None:
    old = b.graph.initializers.get(layer.name + WEIGHT_SUFFIX)
    if old is None:
        raise OnnxExportError(f"layer {layer.name} has no weight {layer.name + WEIGHT_SUFFIX} in the exported graph; "
                              "the model's forward does not use it (or the exporter renamed it): report this model")
    uses = [node for node, _ in old.uses()]
    if not uses:
        raise OnnxExportError(f"the exported graph never reads layer {layer.name}'s weight; report this model")
    first = min(uses, key=b.position.__getitem__)
    b.graph.initializers.pop(old.name)
    weight = _weight_dq(b, layer, first)
    old.replace_all_uses_with(weight)
    weight.name = old.name  # the dequantized weight takes the float initializer's place, name included
    if layer.act is None:
        return
    matmuls = [node for node, index in weight.uses() if node.op_type == "MatMul" and index == 1]
    if len(matmuls) != len(uses):
        raise OnnxExportError(f"layer {layer.name}'s weight feeds {sorted({n.op_type for n in uses})} instead of "
                              "a MatMul, so its activations cannot be quantized; report this model")
    for matmul in matmuls:
        _activation_qdq(b, layer, matmul)


def rewrite(model: ir.Model, layers: list[LayerCodes]) -> None:
    """Turn the float stand-in weights of `layers` into QDQ form, in place (opset 21: int4, blocked scales)."""
    opset = model.opset_imports.get("", 0)
    if opset < 21:
        raise OnnxExportError(f"the graph has opset {opset}; QDQ with int4 codes and blocked scales needs opset 21")
    builder = _Builder(model.graph)
    for layer in layers:
        _rewrite_layer(builder, layer)


def strip_debug_info(model: ir.Model) -> None:
    """Drop what torch.onnx records on each node (stack traces with local paths, FX node text): most of the
    file's size besides the weights, and nothing a runtime reads."""
    for node in model.graph.all_nodes():
        node.metadata_props.clear()
        for value in node.outputs:
            value.metadata_props.clear()


def initializer_bytes(model: ir.Model) -> int:
    """Bytes the graph's constants take: decides whether the weights go to an external data file."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
