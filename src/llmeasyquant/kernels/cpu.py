"""CPU integer kernels built on PyTorch's own int8/int4 operators and on the fused operators of kernels/native.py.

- W8A8: dynamic per-token int8 activations x int8 weights with `torch._int_mm` (int32 accumulation), or for
  decode's few rows the native integer matmul over the stored codes.
- W4A8: the same activations x group-wise int4 weights on the native integer matmul (int32 sums per group; a
  prompt's rows on AMX's int8 tiles where the CPU has them, the same bits).
- W8A16: int8 weights with bf16 activations via `aten._weight_int8pack_mm`, or fp32 ones on the native matmul.
- W4A16: fp32 activations on the native int4 matmul, or for decode 16-bit fixed-point ones on its integer dot
  products; or (and 2/3-bit codes, unpacked from dense storage into
  nibbles when prepared) `aten._weight_int4pack_mm_for_cpu` with bf16 activations; or, for a batch's rows or a
  prompt's, bf16 activations on bf16 dot products (the codes decoded once a call, exact, in the W4A8 tiles).
  That operator needs the input width divisible by the group size; a partial last group is handled by
  zero-padding the input.

The weight-only operators take their 16-bit activations as bf16: with fp32 inputs PyTorch 2.13 runs a scalar
path 30-100x slower than the fp32 matmul, with bf16 a vectorised one (measured in benchmarks/kernel_speed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmeasyquant.grid import LEVELS, grid_levels
from llmeasyquant.infra.memory import huge_page_copy
from llmeasyquant.kernels import native
from llmeasyquant.kernels.kernel import StepCall
from llmeasyquant.kernels.scopes import LOAD_WEIGHTS, NATIVE_GEMM, QUANTIZE_ACTIVATIONS, scope
from llmeasyquant.primitives import MIN_SCALE, grouped_view, pack_int4, qrange, quantize
from llmeasyquant.scheme import ActMode, PerChannel, PerGroup, PerTensor, PerToken

_INT4_GROUPS = (32, 64, 128, 256)
INT8PACK_ALIGNMENT = 16  # bytes: aten._weight_int8pack_mm reads its weight with aligned loads


def quantize_rows_symmetric(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token codes (int8, of `bits` bits) and scales [tokens, 1] of x [tokens, in] in five
    operations: bit for bit what `choose_qparams` + `quantize` give (the max-norm is max |x| exactly; the same
    division and rounding), without their general-purpose grouping, which costs more than the GEMM at decode time.
    Their clamp is left out because it never binds: scale >= max|x| / qmax up to one rounding, so |x / scale| <=
    qmax + 0.5 and the rounded codes lie in [-qmax - 1, qmax] (tested on adversarial inputs)."""
    scale = (torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True) / qrange(bits)[1]).clamp_(min=MIN_SCALE)
    return torch.round(x / scale).to(torch.int8), scale


def _per_row_weights(layer) -> bool:
    return isinstance(layer.scheme.granularity, PerChannel | PerTensor) or layer.group_size == layer.in_features


def _dynamic_symmetric_rows(layer) -> bool:
    """Activations quantized per token at run time, symmetric: what the fused quantize_rows computes."""
    act = layer.scheme.act
    return act.mode is ActMode.DYNAMIC and act.symmetric and isinstance(act.granularity, PerToken)


class Int8DynamicActKernel:
    """W8A8: y = s_x s_w Σ_k (q_x - z_x)(q_w - z_w), expanded so that one int32 GEMM does the work:
    q_x·q_w - z_w Σq_x - z_x Σq_w + K z_x z_w (the zero-point terms only when asymmetric)."""

    name = "cpu_int_mm_w8a8"

    def supports(self, layer) -> bool:
        act = layer.scheme.act
        return (layer.scheme.bits == 8 and _per_row_weights(layer) and act is not None and act.bits == 8
                and isinstance(act.granularity, PerToken | PerTensor))

    def prepare(self, layer) -> dict:
        # The stored [out, in] codes seen as [in, out] column-major: no copy, and oneDNN's int8 GEMM is as fast on
        # it at every M as on a contiguous [in, out] copy, and faster at M=1 (decode).
        wt = layer.qweight.t()
        prepared = {"wt": wt, "scale": layer.scales[:, 0].float(), "w_sum": wt.sum(dim=0, dtype=torch.int32)}
        if layer.zeros is not None:
            prepared["zero"] = layer.zeros[:, 0].to(torch.int32)
        prepared["rows"] = _dynamic_symmetric_rows(layer)
        return prepared

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        # Dynamic symmetric per-token (the common case, decided once): the fused operators of kernels/native.py
        # quantize the activations and scale the output bit for bit as the PyTorch operators below do, in one pass
        # each instead of six and two (3-17x faster at a prompt's 512 rows: benchmarks/native_ops.py).
        fused = native.ops() if prepared["rows"] and "zero" not in prepared else None
        if fused is not None:
            with scope(QUANTIZE_ACTIVATIONS):
                qx, x_scale = fused.quantize_rows(x, MIN_SCALE, 127)
            return fused.dequantize_rows(torch._int_mm(qx, prepared["wt"]), x_scale, prepared["scale"])
        with scope(QUANTIZE_ACTIVATIONS):
            if prepared["rows"]:
                qx, x_scale = quantize_rows_symmetric(x)
                x_zero = None
            else:
                qp = layer.activation_qparams(x)
                qx = quantize(x, qp, layer.scheme.act.bits)
                x_scale, x_zero = qp.scale.expand(x.shape[0], 1), qp.zero  # [tokens, 1]
        acc = torch._int_mm(qx, prepared["wt"])  # [tokens, out] int32
        if "zero" in prepared:
            acc = acc - qx.sum(dim=1, dtype=torch.int32)[:, None] * prepared["zero"][None, :]
        if x_zero is not None:
            w_sum = prepared["w_sum"][None, :]
            if "zero" in prepared:
                w_sum = w_sum - layer.in_features * prepared["zero"][None, :]
            acc = acc - x_zero.expand(x.shape[0], 1) * w_sum
        # int32 * fp32 promotes to fp32: float(acc) * s_x, then * s_w, without a separate conversion pass.
        return torch.mul(acc, x_scale) * prepared["scale"][None, :]

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        if not prepared["rows"] or "zero" in prepared:  # the general path's PyTorch operators: no step kind
            return None
        return StepCall("int_mm", (prepared["wt"], prepared["scale"]))


class NativeInt8Int8Kernel(Int8DynamicActKernel):
    """W8A8 for decode on the native integer matmul: the stored [out, in] codes streamed once, four channels a pass
    and up to four rows sharing each load, VNNI's byte dot products (activations offset to unsigned, the offset taken
    off with each channel's code sum); the same exact int32 sums and scaling as the kernel above, so the same bits.
    oneDNN's GEMM behind `torch._int_mm` is built for many rows (at one row it ran decode slower than the W8A16
    kernels: docs/RESULTS.md); the registry's timing picks between the two per row count. Symmetric weights and
    dynamic symmetric per-token activations, the common W8A8 scheme."""

    name = "cpu_native_w8a8"
    # Above this many rows the parent's torch._int_mm runs (3-4x faster at 512 rows, the same bits), so that timing
    # the candidates for a long prompt does not run this kernel where it never wins.
    DIRECT_ROWS = 16

    def supports(self, layer) -> bool:
        return (super().supports(layer) and layer.zeros is None and _dynamic_symmetric_rows(layer)
                and native.ops() is not None)

    # prepare() is the parent's: each channel's scale and code sum are what this kernel reads too.

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        if rows > self.DIRECT_ROWS:
            return super().step_call(layer, prepared, rows)
        return StepCall("int8_int8", (layer.qweight, prepared["scale"], prepared["w_sum"]))

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        if x.shape[0] > self.DIRECT_ROWS:
            return super().run(layer, x, prepared)
        ops = native.built()  # a layer that chose this kernel keeps it if the switch is turned off later
        with scope(QUANTIZE_ACTIVATIONS):
            qx, x_scale = ops.quantize_rows(x, MIN_SCALE, 127)
        with scope(NATIVE_GEMM):
            return ops.int8_int8_matmul(qx, x_scale, layer.qweight, prepared["scale"], prepared["w_sum"])


class FloatInt8Int8Kernel(NativeInt8Int8Kernel):
    """W8A8 on PyTorch's fp32 GEMM (native `int8_float_matmul`): the same activation codes and weight codes, their
    products summed in fp32, the codes widened a few MB at a time. The integer kernels' result up to fp32's rounding
    of sums past 2^24 (relative 2^-24 an addition: far below the activation codes' rounding); scaled as they scale.
    The fast candidate where the CPU's integer GEMM is slow: without AVX-512 VNNI, torch._int_mm ran 128 rows of
    576 x 3072 at about 4 GFLOP/s (issue 54), a twentieth of the fp32 GEMM it replaces. Symmetric per-channel
    weights and dynamic symmetric per-token activations, at any row count (the choice times it where it can win:
    not at one row, where it has no team form)."""

    name = "cpu_fp32_w8a8"

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        ops = native.built()
        with scope(QUANTIZE_ACTIVATIONS):
            qx, x_scale = ops.quantize_rows(x, MIN_SCALE, 127)
        with scope(NATIVE_GEMM):
            return ops.int8_float_matmul(qx, x_scale, layer.qweight, prepared["scale"])

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        return StepCall("int8_float", (layer.qweight, prepared["scale"]))


class Int8WeightOnlyKernel:
    """W8A16: float activations times per-channel int8 weights, zero points folded in as a rank-1 term."""

    name = "cpu_int8pack_w8a16"

    def supports(self, layer) -> bool:
        # The bf16 path of the operator crashes (segfault) on input widths that are not a multiple of 16, and on
        # codes that do not start on a 16-byte boundary: tensors read from a safetensors file start wherever the
        # file put them (the 1B checkpoint's layers at 8-byte offsets did).
        return (layer.scheme.bits == 8 and layer.scheme.act is None and _per_row_weights(layer)
                and layer.in_features % 16 == 0 and layer.qweight.data_ptr() % INT8PACK_ALIGNMENT == 0)

    def prepare(self, layer) -> dict:
        scale = layer.scales[:, 0].float()
        # Unit scales inside the operator and the fp16 scales applied in fp32 after: bf16 would round them.
        prepared = {"scale": scale, "ones": torch.ones_like(scale, dtype=torch.bfloat16)}
        if layer.zeros is not None:
            prepared["zero_times_scale"] = layer.zeros[:, 0].float() * scale
        return prepared

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        acc = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), layer.qweight, prepared["ones"])
        y = torch.mul(acc, prepared["scale"][None, :])  # promoted to fp32: float(acc) * scale, one operation
        return self._minus_zero_term(y, x, prepared)

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        return StepCall("int8_pack", (layer.qweight, prepared["ones"], prepared["scale"],
                                      prepared.get("zero_times_scale")))

    @staticmethod
    def _minus_zero_term(y: torch.Tensor, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        if "zero_times_scale" in prepared:
            y = y - x.sum(dim=1, keepdim=True) * prepared["zero_times_scale"][None, :]
        return y


class NativeInt8WeightOnlyKernel(Int8WeightOnlyKernel):
    """W8A16 on the int8-weight matmul of kernels/native.py: codes widened to fp32 in registers, fp32 activations and
    sums, so it equals the reference kernel to float rounding (no bf16 step), any input width. Offered where the
    fused operators build; the measured choice runs it where it is the fastest (decode, on the reference machine)."""

    name = "cpu_native_w8a16"

    def supports(self, layer) -> bool:
        return (layer.scheme.bits == 8 and layer.scheme.act is None and _per_row_weights(layer)
                and native.ops() is not None)

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        with scope(NATIVE_GEMM):  # built(): a layer that chose this kernel keeps it if the switch is turned off later
            y = native.built().int8_weight_matmul(x, layer.qweight, prepared["scale"])
        return self._minus_zero_term(y, x, prepared)

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        return StepCall("int8_weight", (layer.qweight, prepared["scale"], prepared.get("zero_times_scale")))


class NativeInt4WeightOnlyKernel:
    """W4A16 on the fused operators. Up to `DIRECT_ROWS` rows the weights are decoded in registers: on CPUs with
    AVX-512 BF16, codes of groups that are multiples of 32 columns become exact bf16 integers and are multiplied by
    bf16 dot products with the activations split into two bf16 numbers (16 significant bits, more than fp16's 11;
    within 2^-16 of sum |x w| of the fp32 reference, where PyTorch's int4 operator rounds activations, scales and
    outputs to bf16); otherwise each weight is dequantized exactly as the reference does it (one AVX-512 table
    lookup) and multiplied with fp32 activations. Above, the fp32 weight is dequantized into memory in one pass and
    multiplied by PyTorch's fp32 GEMM, as the reference does (bit for bit its result, several times faster). 4-bit
    codes (uniform 2/3-bit layers store theirs densely: not taken); on a non-uniform grid (scheme.grid) each group's
    table is levels x scale instead of (code - zero) x scale, always on the fp32 table path, and a 3-bit learned grid
    runs here too, its codes widened to nibbles when prepared."""

    name = "cpu_native_w4a16"
    DIRECT_ROWS = 16

    def supports(self, layer) -> bool:
        group_ok = layer.group_size % 2 == 0 or layer.group_size >= layer.in_features  # even groups start on a byte
        bits_ok = layer.scheme.bits == 4 or (layer.scheme.bits == 3 and layer.scheme.grid is not None)
        return bits_ok and layer.scheme.act is None and group_ok and native.ops() is not None

    def prepare(self, layer) -> dict:
        zeros = layer.zeros.float().contiguous() if layer.zeros is not None else None
        # A 3-bit grid layer's dense codes are widened to nibbles once here (4/3 of their bytes, beside them): the
        # table kernel then reads them as 4-bit codes whose indices fall on the middle 8 entries of a 16-entry table.
        qweight = layer.qweight if layer.scheme.bits == 4 else pack_int4(layer.codes())
        return {"scales": layer.scales.float().contiguous(), "zeros": zeros, "levels": _grid_levels(layer),
                "qweight": qweight}

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        ops = native.built()  # a layer that chose this kernel keeps it if the switch is turned off later
        if prepared["levels"] is not None:
            return self._run_levels(ops, layer, x, prepared)
        if x.shape[0] <= self.DIRECT_ROWS:
            with scope(NATIVE_GEMM):
                return ops.int4_weight_matmul(x, layer.qweight, prepared["scales"], prepared["zeros"],
                                              layer.group_size, True)
        with scope(LOAD_WEIGHTS):
            weight = ops.dequantize_int4(layer.qweight, prepared["scales"], prepared["zeros"], layer.in_features,
                                         layer.group_size)
        return x @ weight.t()

    def _run_levels(self, ops, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        if x.shape[0] <= self.DIRECT_ROWS:
            with scope(NATIVE_GEMM):
                return ops.int4_levels_matmul(x, prepared["qweight"], prepared["scales"], prepared["levels"],
                                              layer.group_size)
        with scope(LOAD_WEIGHTS):
            weight = ops.dequantize_int4_levels(prepared["qweight"], prepared["scales"], prepared["levels"],
                                                layer.in_features, layer.group_size)
        return x @ weight.t()

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        if prepared["levels"] is not None:  # a grid's tables: no step kind
            return None
        kind = "int4_weight" if rows <= self.DIRECT_ROWS else "int4_dequant"
        return StepCall(kind, (layer.qweight, prepared["scales"], prepared["zeros"]))


def _tiles_hold(layer) -> bool:
    """Whether native `int4_tiles_pack` takes the layer's groups: 32 or 64 columns, multiples of 128, one a row."""
    group = layer.group_size
    return group in (32, 64) or group % 128 == 0 or group >= layer.in_features


class NativeInt4DigitsKernel(NativeInt4WeightOnlyKernel):
    """W4A16 decode on integer dot products (native `int4_digits_matmul`): each 32 activations of a row become
    16-bit fixed point, q s with s = max|x| / 32639 over the 32, written as two int8 digits (q = 256 h + l), and the
    stored nibbles multiply them with VNNI's unsigned-by-signed byte dot product: exact int32 sums per 8 columns,
    scaled in fp32. An activation moves by at most max|x| / 65278 of its 32 columns (PyTorch's int4 operator rounds
    to bf16's 8 significant bits; the parent's bf16 path keeps 16 of each value). 1.3-1.9x the parent's speed per
    layer at decode, where decoding each weight in shuffles made the parent compute-bound (docs/RESULTS.md, "W4A16
    on integer dot products"). Uniform 4-bit codes with groups of multiples of 8 columns (or one a row); above
    DIRECT_ROWS rows it is its parent: the dequantized fp32 weight and GEMM.

    Where the groups are 32 or 64 columns, multiples of 128, or one a row, it reads the codes and scales from a
    copy made when prepared (native `int4_tiles_pack`, on 2 MiB pages): tiles of 8 channels x 128 columns, each the
    channels' codes followed by their scales for those columns, so that a thread reads its channels as one
    sequential run with the scales inline, where the stored layout is read as four far streams of codes and four
    of scales. The same sums bit for bit; Llama-3.2-1B's W4A16 g32 engine decode 24.8-27.3 ms a token against
    26.9-29.6 from the stored layout (docs/RESULTS.md, "W4A16 weight tiles"). The copy costs the codes' bytes again
    (the layer keeps its own for prompt rows and the other kernels)."""

    name = "cpu_native_w4a16_i16"

    def supports(self, layer) -> bool:
        group_ok = layer.group_size % 8 == 0 or layer.group_size >= layer.in_features
        return (layer.scheme.bits == 4 and layer.scheme.grid is None and layer.scheme.act is None and group_ok
                and native.ops() is not None)

    def prepare(self, layer) -> dict:
        # fp16 scales are read as stored: no fp32 copy beside them, and half the scale bytes a token (the same sums:
        # fp16 widens to fp32 exactly). Zero points go with them as fp16 (int8 ones exactly). Other scales: fp32.
        half = layer.scales.dtype == torch.float16 and (
            layer.zeros is None or layer.zeros.dtype in (torch.float16, torch.int8, torch.uint8))
        dtype = torch.float16 if half else torch.float32
        zeros = layer.zeros.to(dtype).contiguous() if layer.zeros is not None else None
        scales = layer.scales.to(dtype).contiguous()
        tiles = None
        if _tiles_hold(layer):  # streamed whole every decode step, as the weights are: on 2 MiB pages too
            tiles = huge_page_copy(native.built().int4_tiles_pack(layer.qweight, scales, layer.in_features,
                                                                  layer.group_size))
        return {"scales": scales, "zeros": zeros, "levels": None, "qweight": layer.qweight, "tiles": tiles}

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        if x.shape[0] > self.DIRECT_ROWS:  # the parent's fp32 weight, its scales widened for this call
            zeros = prepared["zeros"].float() if prepared["zeros"] is not None else None
            return super().run(layer, x, {**prepared, "scales": prepared["scales"].float(), "zeros": zeros})
        ops = native.built()
        with scope(NATIVE_GEMM):
            if prepared["tiles"] is not None:
                return ops.int4_tiles_matmul(x, prepared["tiles"], prepared["scales"], prepared["zeros"],
                                             layer.group_size)
            return ops.int4_digits_matmul(x, layer.qweight, prepared["scales"], prepared["zeros"], layer.group_size)

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        if rows <= self.DIRECT_ROWS and prepared["tiles"] is not None:
            return StepCall("int4_tiles", (prepared["tiles"], prepared["scales"], prepared["zeros"]))
        if rows <= self.DIRECT_ROWS:
            return StepCall("int4_digits", (layer.qweight, prepared["scales"], prepared["zeros"]))
        zeros = prepared["zeros"].float() if prepared["zeros"] is not None else None  # as run() widens them
        return StepCall("int4_dequant", (layer.qweight, prepared["scales"].float(), zeros))


class Bf16DequantInt4Kernel(NativeInt4WeightOnlyKernel):
    """W4A16 for a prompt's rows on bf16 dot products (native `int4_bf16_matmul`): the weight dequantized as the
    reference does it, 4 MB of it at a time, rounded to bf16, times the activations rounded to bf16, by PyTorch's
    bf16 GEMM (oneDNN: AVX-512 BF16 or AMX where the CPU has them; fp32 sums, the outputs rounded to bf16). Weights,
    activations and outputs keep 8 significant bits, as in PyTorch's int4 operator (`cpu_int4pack_w4a16`, which also
    rounds the scales); where the CPU lacks bf16 arithmetic it is slow and the measured choice passes it by.
    2.4-3.4x PyTorch's fp32 GEMM at 512 rows on an AVX-512 BF16 EPYC (docs/RESULTS.md, "One decode path"). Uniform
    4-bit codes; last in the registry, so `first` mode never takes it."""

    name = "cpu_bf16_w4a16"

    def supports(self, layer) -> bool:
        return layer.scheme.grid is None and super().supports(layer)

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        with scope(NATIVE_GEMM):
            return native.built().int4_bf16_matmul(x, layer.qweight, prepared["scales"], prepared["zeros"],
                                                   layer.in_features, layer.group_size)

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        return StepCall("int4_bf16", (layer.qweight, prepared["scales"], prepared["zeros"]))


class Bf16TilesInt4Kernel:
    """W4A16 for a batch's rows on bf16 dot products (native `int4_bf16_tiles_matmul`): the W4A8 kernel's tiles of 16
    channels x 8 columns, each byte decoded once a call into two exact bf16 words (u - 8) that up to 12 rows share, one
    vdpbf16ps multiplying a row's two activations into the 16 channels' fp32 lanes; each group's sum scaled in fp32,
    zero points taken off with the group's activation sum. The activations are rounded to bf16 (8 significant bits,
    as PyTorch's int4 operator and `cpu_bf16_w4a16` round them); the weights, scales and sums are not, where those
    two round the dequantized weights and the outputs to bf16 as well. Where the CPU has AVX-512 BF16 (elsewhere its
    one-value-at-a-time form would never win a timing: not offered); last in the registry, so `first` mode keeps 16
    bits of every activation. Uniform 4-bit codes, integer zero points, groups of multiples of 8 columns (or one a
    row)."""

    name = "cpu_bf16dot_w4a16"

    def supports(self, layer) -> bool:
        ops = native.ops()
        group_ok = layer.group_size % 8 == 0 or layer.group_size >= layer.in_features
        zeros_ok = layer.zeros is None or bool(torch.equal(layer.zeros.float(), layer.zeros.float().round()))
        return (layer.scheme.bits == 4 and layer.scheme.grid is None and layer.scheme.act is None and group_ok
                and zeros_ok and ops is not None and ops.bf16_dot_built())

    def prepare(self, layer) -> dict:
        # In ordinary memory: a batch's rows make this kernel compute-bound (the serving run on this placement was no
        # slower), and the 2 MiB pages stay for the copies a one-row decode streams.
        return int4_tiles(layer, huge_pages=False)

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        with scope(NATIVE_GEMM):
            return native.built().int4_bf16_tiles_matmul(x, *self._tensors(layer, prepared), layer.group_size,
                                                         layer.out_features)

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        return StepCall("int4_bf16_tiles", self._tensors(layer, prepared))

    @staticmethod
    def _tensors(layer, prepared: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return prepared["tiled"], prepared["scales"], prepared["offsets"] if layer.zeros is not None else None


def _grid_levels(layer) -> torch.Tensor | None:
    """A grid layer's levels as the native operators take them: fp32 [16] (a fixed table) or [out, 16] (learned).
    A learned 8-level table (3 bits) sits at indices 4..11, where codes -4..3 plus 8 land; the ends repeat."""
    if layer.scheme.grid is None:
        return None
    if layer.levels is None:
        return grid_levels(layer.scheme.grid).to(layer.scales.device).contiguous()
    levels = layer.levels.float()
    pad = (LEVELS - levels.shape[1]) // 2
    return torch.nn.functional.pad(levels[:, None], (pad, pad), mode="replicate")[:, 0].contiguous()


def tile_int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit codes [out, in] -> the W4A8 operator's tiles [tiles, blocks, 16, 4] uint8 (native
    matmul_kernels.cpp, `Int4TiledWeights`): per 16 output channels and 8 input columns, byte c of a channel holds
    column c in its low nibble and column 4 + c in its high one, as u = code + 8. Rows are padded to whole tiles and
    columns to whole blocks (padding meets zero activations or is never stored)."""
    out, width = codes.shape
    tiles, blocks = -(-out // 16), -(-width // 8)
    unsigned = torch.nn.functional.pad((codes.to(torch.int16) + 8).to(torch.uint8),
                                       (0, blocks * 8 - width, 0, tiles * 16 - out), value=8)
    grouped = unsigned.reshape(tiles, 16, blocks, 8).permute(0, 2, 1, 3)  # [tiles, blocks, 16 channels, 8 columns]
    return (grouped[..., :4] | (grouped[..., 4:] << 4)).contiguous()


def int4_tiles(layer, huge_pages: bool) -> dict:
    """A 4-bit layer's codes as `tile_int4_codes` lays them out (on 2 MiB pages where `huge_pages`: for a kernel
    that streams them whole every decode step), with scales and offsets (8 + zero) as [groups, padded out], so that
    the 16 channels of a tile read theirs as one vector each: what the W4A8 operator and the W4A16 bf16 tiles
    operator read."""
    tiled = tile_int4_codes(layer.codes())
    tiled = huge_page_copy(tiled) if huge_pages else tiled
    extra = tiled.shape[0] * 16 - layer.out_features
    offsets = torch.full_like(layer.scales, 8, dtype=torch.int32)
    if layer.zeros is not None:
        offsets += layer.zeros.to(torch.int32)
    return {"tiled": tiled, "scales": torch.nn.functional.pad(layer.scales.float().t(), (0, extra)).contiguous(),
            "offsets": torch.nn.functional.pad(offsets.t(), (0, extra)).contiguous()}


class NativeInt4Int8Kernel:
    """W4A8 (and W4A4) on the native integer matmul: dynamic int8 (or 4-bit) activations per token (the fused
    quantize_rows, or quantize_rows_asym with zero points), 4-bit group-wise weights unpacked to bytes in registers,
    int32 sums per group (VNNI where the CPU has it) scaled in fp32: the reference kernel's integer product, exact
    per group (bit for bit with per-channel weights; with groups, the fp32 sum over groups may round differently).
    Groups must be multiples of 8 wide (or span the row). Calls of 32 rows or more (a prompt) on 512 channels or
    more run on AMX's int8 tiles where the CPU and OS allow (native/w4a8_amx.cpp: the same int32 sums and fp32
    steps, so the same bits; 1.6-1.8x the VNNI loop on a 512-row GEMM of SmolLM2's shapes, docs/RESULTS.md "W4A8
    prefill on AMX tiles").

    Asymmetric activations (codes q_x with a zero point z_x per token): the kernel multiplies q_x as they are, and
    s_x Σ_k (q_x - z_x) Ŵ_k = kernel(q_x) - s_x z_x Σ_k Ŵ_k, with Σ_k Ŵ_k (each output channel's dequantized weight
    sum) computed once in prepare: one rank-1 correction, no second pass over the weights.

    Activation groups (`--act-group-size`, the weights' group size): one scale (and zero point) per token per group,
    each group's int32 sum scaled by its weight scale times its activation scale; the zero points' correction is
    then Σ_g s_x,g z_x,g Σ_{k in g} Ŵ_k, a [tokens, groups] x [groups, out] product with the per-group weight sums.
    These take the VNNI loop (the AMX strips scale a row once)."""

    name = "cpu_native_w4a8"

    def supports(self, layer) -> bool:
        act = layer.scheme.act
        group_ok = layer.group_size % 8 == 0 or layer.group_size >= layer.in_features
        # Activation groups are the weights' groups (the scheme checks); one that spans the row is one a token.
        return (layer.scheme.bits == 4 and act is not None and act.mode is ActMode.DYNAMIC
                and isinstance(act.granularity, PerToken | PerGroup) and group_ok and native.ops() is not None)

    def prepare(self, layer) -> dict:
        prepared = int4_tiles(layer, huge_pages=True)
        if not layer.scheme.act.symmetric:
            weight = layer.dequantize()
            prepared["weight_sums"] = (weight.sum(dim=1) if layer.scheme.act.group_size is None
                                       else grouped_view(weight, layer.group_size).sum(dim=2).t().contiguous())
        return prepared

    def run(self, layer, x: torch.Tensor, prepared: dict) -> torch.Tensor:
        ops = native.built()  # a layer that chose this kernel keeps it if the switch is turned off later
        act = layer.scheme.act
        with scope(QUANTIZE_ACTIVATIONS):
            if act.group_size is None or x.shape[1] % act.group_size == 0:
                # The fused quantizers, per row; with whole groups each group of a token is a row of theirs.
                rows = x if act.group_size is None else x.reshape(-1, act.group_size)
                if act.symmetric:
                    qx, x_scale = ops.quantize_rows(rows, MIN_SCALE, qrange(act.bits)[1])
                else:
                    qx, x_scale, x_zero = ops.quantize_rows_asym(rows, MIN_SCALE, *qrange(act.bits))
                    x_zero = x_zero.reshape(x.shape[0], -1)
                qx, x_scale = qx.reshape(x.shape), x_scale.reshape(x.shape[0], -1)
            else:
                qp = layer.activation_qparams(x)
                qx, x_scale, x_zero = quantize(x, qp, act.bits), qp.scale, qp.zero
        with scope(NATIVE_GEMM):
            y = ops.int4_int8_matmul(qx, x_scale, prepared["tiled"], prepared["scales"], prepared["offsets"],
                                     layer.group_size, layer.out_features)
        if act.symmetric:
            return y
        if act.group_size is not None:  # [tokens, groups] x [groups, out]
            return y - (x_scale * x_zero) @ prepared["weight_sums"]
        return y - (x_scale * x_zero) * prepared["weight_sums"][None, :]

    def step_call(self, layer, prepared: dict, rows: int) -> StepCall | None:
        act = layer.scheme.act
        if act.group_size is not None and layer.in_features % act.group_size != 0:  # the general quantizer
            return None
        return StepCall("int4_int8", (prepared["tiled"], prepared["scales"], prepared["offsets"],
                                      prepared.get("weight_sums")), act_range=qrange(act.bits),
                        act_group=act.group_size or 0)


@dataclass(frozen=True)
class _Int4Prepared:
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int
    padded_in: int


class Int4WeightOnlyKernel:
    """W4A16: weights as (u - 8) * scale + zf with u = q + 8 and zf = -zero * scale, the operator's form."""

    name = "cpu_int4pack_w4a16"

    def supports(self, layer) -> bool:
        # The operator computes (u - 8) * scale + zf: uniform codes only, not a grid's table.
        return (layer.scheme.bits <= 4 and layer.scheme.act is None and layer.scheme.grid is None
                and self._group(layer) is not None)

    @staticmethod
    def _group(layer) -> int | None:
        if layer.group_size in _INT4_GROUPS:
            return layer.group_size
        # Per-channel weights: the operator takes them as groups of 128 that repeat one scale per row.
        return 128 if layer.group_size == layer.in_features else None

    def prepare(self, layer) -> _Int4Prepared:
        group = self._group(layer)
        groups = -(-layer.in_features // group)
        padded_in = groups * group
        codes = layer.codes().to(torch.int32) + 8  # [out, in] in 0..15
        # The operator wants out % 16 == 0: extra rows are computed and sliced away. Padded input columns
        # meet zero-padded activations, so their weight values never contribute.
        pad_out = -layer.out_features % 16
        codes = torch.nn.functional.pad(codes, (0, padded_in - layer.in_features, 0, pad_out), value=8)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        repeat = groups // layer.scales.shape[1]  # 1, or the group count when one scale covers a row
        scale = layer.scales.float().repeat_interleave(repeat, dim=1)  # [out, groups]
        zeros = layer.zeros.float().repeat_interleave(repeat, dim=1) if layer.zeros is not None else None
        zf = -zeros * scale if zeros is not None else torch.zeros_like(scale)
        scale = torch.nn.functional.pad(scale, (0, 0, 0, pad_out), value=1.0)
        zf = torch.nn.functional.pad(zf, (0, 0, 0, pad_out))
        scales_and_zeros = torch.stack((scale.t(), zf.t()), dim=-1).to(torch.bfloat16).contiguous()
        return _Int4Prepared(packed, scales_and_zeros, group, padded_in)

    def run(self, layer, x: torch.Tensor, prepared: _Int4Prepared) -> torch.Tensor:
        if prepared.padded_in > layer.in_features:
            x = torch.nn.functional.pad(x, (0, prepared.padded_in - layer.in_features))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), prepared.packed, prepared.group, prepared.scales_and_zeros)
        return (y if y.shape[1] == layer.out_features else y[:, : layer.out_features]).float()

    def step_call(self, layer, prepared: _Int4Prepared, rows: int) -> StepCall | None:
        return StepCall("int4_pack", (prepared.packed, prepared.scales_and_zeros), padded_in=prepared.padded_in,
                        group_size=prepared.group)
