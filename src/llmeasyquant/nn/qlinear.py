"""QuantLinear: a linear layer whose weights are stored as packed integers and run by an integer kernel."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.grid import grid_levels, level_count
from llmeasyquant.kernels.choice import is_pinned, row_bucket
from llmeasyquant.kernels.clipping import limit_activations
from llmeasyquant.kernels.scopes import LAYER_SCOPE, LOAD_WEIGHTS, scope
from llmeasyquant.nn.observers import ema_step, observed_extremes
from llmeasyquant.nn.positions import sink_rows
from llmeasyquant.primitives import (
    QParams,
    check_finite,
    choose_qparams,
    dequantize,
    pack_bits,
    pack_int4,
    quantize,
    unpack_bits,
    unpack_int4,
)
from llmeasyquant.scheme import ActMode, PerTensor, QuantScheme

log = logging.getLogger(__name__)

# Float state kept in fp32 when the rest is rounded to fp16 for storage: the online range moves by small EMA steps;
# an online input transform (nn/transform.py) must stay orthogonal to fp32 rounding.
FULL_PRECISION_STATE = ("inv_freq", "input_range", "input_transform.signs", "input_transform.odd")


def packed_width(bits: int, in_features: int) -> int:
    """Bytes per row of `qweight`: 8-bit codes as int8, 4-bit two per byte (the int4 kernels' layout), 2- and
    3-bit densely, each run of 8 codes in `bits` bytes (so a 3-bit layer really takes 3 bits per weight)."""
    if bits == 8:
        return in_features
    if bits == 4:
        return -(-in_features // 2)
    return -(-in_features // 8) * bits


def layer_storage_bytes(in_features: int, out_features: int, scheme: QuantScheme) -> int:
    """Bytes a QuantLinear of this shape and scheme stores: codes, fp16 scales, int8 zero points, a learned grid's
    fp16 tables (no bias)."""
    groups = -(-in_features // min(scheme.group_size or in_features, in_features))
    per_group = 2 if scheme.symmetric else 3
    table = 2 * level_count("learned", scheme.bits) if scheme.grid == "learned" else 0
    return out_features * (packed_width(scheme.bits, in_features) + groups * per_group + table)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [out, in] in the signed domain -> the `qweight` layout for `bits`."""
    if bits == 8:
        return codes
    if bits == 4:
        return pack_int4(codes)
    return pack_bits((codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8), bits)


def _unpack(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of `_pack`: int8 codes [out, in] in the signed domain."""
    if bits == 8:
        return qweight
    if bits == 4:
        return unpack_int4(qweight, in_features)
    return (unpack_bits(qweight, bits, in_features).to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


class QuantLinear(nn.Module):
    """y = x @ ((q - zero) * scale)^T + bias, computed by a kernel chosen for the scheme and device; with a grid
    (scheme.grid) the weight is levels[q + L/2] * scale instead, levels the grid's fixed table or, learned, `levels`
    (L = 2^bits levels).

    Buffers (all in the state dict): `qweight` int8 [out, in] for 8-bit, uint8 [out, ceil(in/2)] for 4-bit,
    uint8 [out, ceil(in/8) * bits] for 2 and 3 bits (`packed_width`); `scales` fp16 [out, groups]; `zeros` int8
    [out, groups] when asymmetric; `levels` fp16 [out, 2^bits] for a learned grid; `bias` if any; with static
    activations, `input_scale` fp16 [1] (NaN until calibrated) and `input_zero` int8 [1] when the activations are
    asymmetric.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.group_size = min(scheme.group_size or in_features, in_features)
        groups = -(-in_features // self.group_size)
        dtype = torch.int8 if scheme.bits == 8 else torch.uint8
        width = packed_width(scheme.bits, in_features)
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=dtype))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        if not scheme.symmetric:
            self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.int8))
        else:
            self.zeros = None
        self.register_buffer("levels", torch.zeros(out_features, level_count("learned", scheme.bits),
                                                   dtype=torch.float16) if scheme.grid == "learned" else None)
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype))
        else:
            self.bias = None
        # Static and online activations keep one per-tensor scale; online ones also the tracked fp32 [lo, hi].
        mode = None if scheme.act is None else scheme.act.mode
        tracked, online = mode in (ActMode.STATIC, ActMode.ONLINE), mode is ActMode.ONLINE
        act_asym = scheme.act is not None and not scheme.act.symmetric
        self.register_buffer("input_scale", torch.full((1,), float("nan"), dtype=torch.float16) if tracked else None)
        self.register_buffer("input_zero", torch.zeros(1, dtype=torch.int8) if tracked and act_asym else None)
        self.register_buffer("input_range", torch.full((2,), float("nan")) if online else None)
        self.observing = False  # True while static input ranges are being measured: scales come from x itself
        self.kernel_name: str | None = None  # force one kernel (tests, benchmarks); None = registry's choice
        self._kernels: dict[tuple[int, int, bool], Any] = {}  # (row bucket, threads, pinned) -> its kernel
        self._prepared: dict[str, Any] = {}  # kernel name -> what it prepared from the buffers
        self.shared: tuple[Any, int] | None = None  # (nn.fused.SharedInputCall, my index) when fused
        self.profile_name = "linear"  # the name of this layer's profiler scope (eval/speed.py sets it)
        # An orthogonal map applied to the input before the kernel (nn/transform.py: rotate's online Hadamard),
        # a submodule when set; its transpose is folded into the weights.
        self.input_transform: nn.Module | None = None

    # construction --------------------------------------------------------------------------------
    @classmethod
    def from_codes(cls, codes: torch.Tensor, qp: QParams, scheme: QuantScheme,
                   bias: torch.Tensor | None) -> QuantLinear:
        """Wrap already-computed codes [out, in] (int8, signed domain) and their scales/zeros."""
        out_features, in_features = codes.shape
        layer = cls(in_features, out_features, scheme, bias is not None,
                    bias.dtype if bias is not None else torch.float32)
        if qp.group_size != layer.group_size:
            raise ValueError(f"group width {qp.group_size} does not match the scheme's {layer.group_size}")
        layer.qweight.copy_(_pack(codes, scheme.bits))
        layer.scales.copy_(qp.scale.expand_as(layer.scales).to(torch.float16))
        if layer.zeros is not None:
            layer.zeros.copy_(qp.zero.expand_as(layer.zeros).to(torch.int8))
        if (qp.levels is None) != (scheme.grid is None):
            raise ValueError(f"codes {'without' if qp.levels is None else 'with'} grid levels for scheme {scheme.name}")
        if layer.levels is not None:
            layer.levels.copy_(qp.levels.expand_as(layer.levels).to(torch.float16))
        if bias is not None:
            layer.bias.copy_(bias.detach())
        return layer

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, scheme: QuantScheme,
                    name: str = "weight") -> QuantLinear:
        """Round-to-nearest quantization of a float weight [out, in] (on a grid: to the nearest level)."""
        check_finite(weight, name)
        qp = choose_qparams(weight, scheme.bits, scheme.symmetric, scheme.granularity, grid=scheme.grid)
        return cls.from_codes(quantize(weight, qp, scheme.bits), qp, scheme, bias)

    # views ---------------------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """int8 codes [out, in] in the signed domain."""
        return _unpack(self.qweight, self.scheme.bits, self.in_features)

    def qparams(self) -> QParams:
        zero = None if self.zeros is None else self.zeros.to(torch.int32)
        return QParams(scale=self.scales.float(), zero=zero, group_size=self.group_size, levels=self.grid_levels())

    def grid_levels(self) -> torch.Tensor | None:
        """The grid's levels, fp32 [1, 16] (fixed table) or [out, 2^bits] (learned); None for uniform codes."""
        if self.scheme.grid is None:
            return None
        if self.levels is not None:
            return self.levels.float()
        return grid_levels(self.scheme.grid).to(self.scales.device)[None, :]

    @property
    def static_input(self) -> bool:
        return self.input_scale is not None

    def set_input_range(self, lo: float, hi: float) -> None:
        """Calibrate the static activation scale from the range of this layer's inputs."""
        act = self.scheme.act
        qp = choose_qparams(torch.tensor([[lo, hi]]), act.bits, act.symmetric, act.granularity)
        self.input_scale.copy_(qp.scale.reshape(1))
        if self.input_zero is not None:
            self.input_zero.copy_(qp.zero.reshape(1).to(torch.int8))

    def activation_qparams(self, x: torch.Tensor) -> QParams:
        """Scale (and zero point) of the activations x [tokens, in]: the stored static ones, from x itself, or
        (online) from the range tracked over every input so far, x included; values beyond it are clipped."""
        act = self.scheme.act
        if self.input_scale is None or self.observing:
            return choose_qparams(x, act.bits, act.symmetric, act.granularity, scale_dtype=None)
        if self.input_range is not None:
            self._track_input_range(x)
        else:
            self.check_input_scale()
        zero = None if self.input_zero is None else self.input_zero.to(torch.int32).reshape(1, 1)
        return QParams(scale=self.input_scale.float().reshape(1, 1), zero=zero, group_size=x.shape[1])

    def check_input_scale(self, name: str = "this layer") -> None:
        """Raise if the static or online activation scale is not set yet (NaN): nothing to quantize or export with."""
        if self.input_scale is None or bool(torch.isfinite(self.input_scale).all()):
            return
        if self.input_range is not None:
            raise ConfigError(f"{name} tracks its activation range online and has seen no input yet, so it has no "
                              "scale to use or export: run the model on some text and save it (Python: model(ids), "
                              "then llmeasyquant.save), or quantize with --act-mode static --calib PATH")
        raise ConfigError(f"{name} has static activation scales that were never calibrated: quantize with "
                          "calibration data (--calib) or use dynamic activations")

    def _track_input_range(self, x: torch.Tensor) -> None:
        """Online mode: fold x into the EMA range and store the scale it gives (fp16, like a static one, so an
        export of the layer freezes exactly the scale in use)."""
        act = self.scheme.act
        observed = observed_extremes(x, act.symmetric, act.eps, act.std_floor)
        self.input_range.copy_(ema_step(self.input_range, observed, act.momentum))
        qp = choose_qparams(self.input_range.reshape(1, 2), act.bits, act.symmetric, PerTensor())
        self.input_scale.copy_(qp.scale.reshape(1))
        if self.input_zero is not None:
            self.input_zero.copy_(qp.zero.reshape(1).to(torch.int8))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] these integers stand for."""
        return dequantize(self.codes(), self.qparams())

    def storage_bytes(self) -> int:
        """Bytes of codes, scales, zero points and a learned grid's tables (the bias is not counted: not quantized)."""
        tensors = [self.qweight, self.scales] + [t for t in (self.zeros, self.levels) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # compute -------------------------------------------------------------------------------------
    def forget_kernel(self) -> None:
        """Drop what the kernel prepared from the buffers (after they were overwritten in place); a fused layer's
        buffers are views into its group's, so the group's preparation goes too."""
        self._kernels, self._prepared = {}, {}
        self.__dict__.pop("_sink_twin", None)
        if self.shared is not None:
            self.shared[0].combined.forget_kernel()

    def _apply(self, fn, recurse: bool = True):
        # Moving or casting the module invalidates whatever the kernel prepared from the buffers, and gives each
        # fused layer its own copies of the buffers it shared.
        self.forget_kernel()
        self.shared = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self.forget_kernel()
        super()._load_from_state_dict(*args, **kwargs)

    def kernel(self, rows: int = 1) -> Any:
        """The kernel that runs inputs of `rows` rows (chosen on first use of its row bucket), prepared."""
        # The fastest kernel depends on rows and threads; calibration pins one (kernels/choice.py's `pinned`).
        key = (row_bucket(rows), torch.get_num_threads(), is_pinned())
        kernel = self._kernels.get(key)
        if kernel is None:
            from llmeasyquant.kernels import select

            kernel = self._kernels[key] = select(self, rows)
            self.prepared_for(kernel)
        return kernel

    def chosen_kernels(self) -> dict[int, str]:
        """Row bucket -> name of the kernel chosen for it at the current thread count, for the buckets used so far."""
        threads = torch.get_num_threads()
        return {rows: kernel.name for (rows, at, pinned), kernel in sorted(self._kernels.items())
                if at == threads and not pinned}

    def prepared_for(self, kernel: Any) -> Any:
        """What `kernel` prepares from the buffers (repacked weights, scales), made once and kept."""
        if kernel.name not in self._prepared:
            with scope(LOAD_WEIGHTS):
                self._prepared[kernel.name] = kernel.prepare(self)
        return self._prepared[kernel.name]

    def release_unchosen(self) -> None:
        """Drop what kernels prepared that no row bucket chose: the timing prepares every candidate (a repacked
        copy of the codes for some), and only the winners run. A bucket chosen later prepares its winner again."""
        chosen = {kernel.name for kernel in self._kernels.values()}
        self._prepared = {name: data for name, data in self._prepared.items() if name in chosen}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.shared is not None:
            call, index = self.shared
            return call.output(index, self, x)
        with scope(LAYER_SCOPE + self.profile_name):
            return self._compute(x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        # Clipping and sink rows here rather than in forward: fused members pass one input tensor to the combined
        # layer, which runs them once.
        act = self.scheme.act
        sinks = None if act is None or not act.sinks else sink_rows(x.numel() // self.in_features, act.sinks)
        clipped = x if act is None or not act.clips else limit_activations(x, act)
        y = self._run_kernel(clipped)
        if sinks is not None:  # the first positions of each sequence again, with 8-bit activations
            rows = y.view(-1, self.out_features)
            rows[sinks] = self._sink_layer()._run_kernel(x.reshape(-1, self.in_features)[sinks]).to(y.dtype)
        return y

    def _sink_layer(self) -> QuantLinear:
        """This layer with 8-bit unclipped activations and no sinks, for the sink rows: the same buffers and the same
        prepared weights (kernels that take both activation widths prepare nothing that depends on them), made once
        and kept outside the module tree (not a submodule: no state of its own)."""
        twin = self.__dict__.get("_sink_twin")
        if twin is None:
            twin = QuantLinear.__new__(QuantLinear)
            twin.__dict__.update(self.__dict__)
            act = dataclasses.replace(self.scheme.act, bits=8, clip=1.0, clip_search=False, sinks=0)
            twin.scheme = dataclasses.replace(self.scheme, act=act)
            twin._kernels, twin.shared = {}, None
            self.__dict__["_sink_twin"] = twin
        return twin

    def _run_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # e.g. the LM head of a step whose prompt rows want no logits: no kernel to run
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and x.dtype == torch.float32:  # the decode loop's case: no reshaping or casting to do
            kernel = self.kernel(x.shape[0])
            y = kernel.run(self, x, self._prepared[kernel.name])
            return y if self.bias is None else y + self.bias.float()
        shape = x.shape
        x2d = x.reshape(-1, self.in_features).float()
        kernel = self.kernel(x2d.shape[0])
        y = kernel.run(self, x2d, self._prepared[kernel.name])
        if self.bias is not None:
            y = y + self.bias.float()
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        chosen = ", ".join(f"{rows}: {name}" for rows, name in self.chosen_kernels().items()) or "not chosen yet"
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, kernel by rows=({chosen})"


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """Every QuantLinear of `model`, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


@contextlib.contextmanager
def forced_kernel(model: Any, name: str) -> Iterator[None]:
    """Run every QuantLinear of `model` on kernel `name` inside the block, then restore each layer's choice."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    before = [layer.kernel_name for layer in layers]
    try:
        for layer in layers:
            layer.kernel_name = name
            layer.forget_kernel()
        yield
    finally:
        for layer, kernel_name in zip(layers, before, strict=True):
            layer.kernel_name = kernel_name
            layer.forget_kernel()
