"""Our integer codes and scales as GGUF blocks (Q8_0, Q4_0, Q4_1), repacked byte for byte instead of re-rounded.

A GGUF block holds 32 weights of one row with one fp16 scale `d` (and, for Q4_1, one fp16 offset `m`):
  Q8_0: d, then 32 int8 codes                        value = d * q
  Q4_0: d, then 16 bytes of nibbles n in [0, 15]     value = d * (n - 8)
  Q4_1: d, m, then 16 bytes of nibbles               value = d * n + m
Nibble order (Q4_0, Q4_1): byte j holds weight j in its low nibble and weight j + 16 in its high nibble.

Our value is (q - zero) * scale with one fp16 scale per group. A group of k * 32 weights (k >= 1, per-channel rows
included) is k whole blocks sharing the group's scale, so its codes fit a block type exactly when the bits do:
  8-bit symmetric        -> Q8_0, d = scale, codes as they are
  2/3/4-bit symmetric    -> Q4_0, d = scale, n = q + 8 (a 2- or 3-bit code uses part of the nibble's range)
  2/3/4-bit asymmetric   -> Q4_1, d = scale, n = q + 8, m = -(zero + 8) * scale
Q4_1's m is stored in fp16: (zero + 8) * scale is exact in fp32 but not always representable in fp16, so m is the
fp16 rounding of it (codes and d stay bit-exact). Everything else is re-quantized from the dequantized weight:
8-bit asymmetric (q - zero spans up to 255 levels, more than int8 holds) -> Q8_0; 2/3/4-bit with groups that are
not a multiple of 32 -> Q4_0 / Q4_1 (the same storage class); rows whose length is not a multiple of 32 -> F16.

Non-uniform grids (scheme.grid, grid.py): our value is levels[n] * scale with n = q + 8.
  IQ4_NL: d, then 16 bytes of nibbles (Q4_0's order)  value = d * kvalues_iq4nl[n]
  iq4nl grid, groups of k * 32                  -> IQ4_NL, d = scale / 128 (fp16-exact: grid.py picks such scales),
                                                   n as it is; d * kvalue is the same fp32 product as our
                                                   (kvalue / 128) * scale, so the weights are equal bit for bit
  nf4 or learned grid, or iq4nl in other groups -> IQ4_NL re-quantized by our own iq4nl rounding (grid.py) per block
                                                   of 32 from the dequantized weight: the nearest GGUF type
gguf's Python quantizer has no IQ4_NL, hence our rounding, not llama.cpp's (which also refines d, a little
differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from llmeasyquant.grid import IQ4NL_DIVISOR, grid_params
from llmeasyquant.primitives import QParams, dequantize, quantize

BLOCK = 32  # weights per block in Q8_0, Q4_0 and Q4_1


@dataclass(frozen=True)
class Packed:
    """A weight as GGUF stores it: uint8 block bytes [out, bytes per row] (or an F16 array [out, in])."""

    data: np.ndarray
    qtype: QType
    exact: bool  # the layer's codes and scales carried over without rounding again
    m_rounded: int = 0  # Q4_1 blocks whose m = -(zero + 8) * scale was not fp16-representable


def block_type(bits: int, symmetric: bool, group_size: int, in_features: int,
               grid: str | None = None) -> tuple[QType, bool]:
    """The block type a layer is written in, and whether it holds the layer's codes exactly."""
    if in_features % BLOCK:
        return QType.F16, False
    aligned = group_size % BLOCK == 0
    if grid is not None:
        return QType.IQ4_NL, aligned and grid == "iq4nl"
    if bits == 8:
        return QType.Q8_0, aligned and symmetric
    return (QType.Q4_0 if symmetric else QType.Q4_1), aligned


def _per_block(params: torch.Tensor, group_size: int, blocks: int) -> torch.Tensor:
    """Per-group values [out, groups] -> per-block [out, blocks]: a group of k * 32 weights spans k blocks."""
    return params.repeat_interleave(group_size // BLOCK, dim=1)[:, :blocks]


def _fp16_bytes(values: torch.Tensor) -> np.ndarray:
    """[out, blocks] values -> [out, blocks, 2] little-endian fp16 bytes."""
    return values.to(torch.float16).numpy().astype("<f2").view(np.uint8).reshape(*values.shape, 2)


def _nibbles(codes: torch.Tensor, blocks: int) -> np.ndarray:
    """int8 codes [out, in] in [-8, 7] -> [out, blocks, 16] bytes in Q4's nibble order (n = q + 8)."""
    n = (codes.to(torch.int16) + 8).to(torch.uint8).numpy().reshape(codes.shape[0], blocks, BLOCK)
    return n[..., : BLOCK // 2] | (n[..., BLOCK // 2:] << np.uint8(4))


def _rows(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-block byte fields [out, blocks, *] into rows [out, blocks * block bytes]."""
    joined = np.concatenate(parts, axis=-1)
    return np.ascontiguousarray(joined.reshape(joined.shape[0], -1))


def pack_exact(codes: torch.Tensor, qp: QParams, qtype: QType) -> Packed:
    """Repack codes [out, in] and their scales (and zeros) into `qtype` blocks without rounding the codes again."""
    out, cols = codes.shape
    blocks = cols // BLOCK
    d = _per_block(qp.scale, qp.group_size, blocks)  # [out, blocks], fp16-representable already
    if qtype == QType.Q8_0:
        qs = codes.numpy().reshape(out, blocks, BLOCK).view(np.uint8)
        return Packed(_rows([_fp16_bytes(d), qs]), qtype, exact=True)
    if qtype == QType.Q4_0:
        return Packed(_rows([_fp16_bytes(d), _nibbles(codes, blocks)]), qtype, exact=True)
    if qtype == QType.IQ4_NL:
        d = d / IQ4NL_DIVISOR  # a power of two: exact, and fp16-representable by the iq4nl grid's choice of scales
        if not torch.equal(d.to(torch.float16).float(), d):
            raise ValueError("iq4nl scales must be 128 x an fp16 number; quantize with the iq4nl grid of grid.py")
        return Packed(_rows([_fp16_bytes(d), _nibbles(codes, blocks)]), qtype, exact=True)
    zero = _per_block(qp.zero, qp.group_size, blocks).float()
    m = -(zero + 8) * d  # exact in fp32: an 11-bit significand times an integer below 16
    rounded = int((m.to(torch.float16).float() != m).sum())
    return Packed(_rows([_fp16_bytes(d), _fp16_bytes(m), _nibbles(codes, blocks)]), qtype, exact=True,
                  m_rounded=rounded)


def requantize(weight: torch.Tensor, qtype: QType) -> Packed:
    """Round a float weight [out, in] into `qtype` with gguf's reference quantizer (llama.cpp's rounding); IQ4_NL,
    which gguf cannot quantize, with our iq4nl grid on blocks of 32."""
    if qtype == QType.IQ4_NL:
        weight = weight.detach().float()
        scale, levels = grid_params(weight, "iq4nl", BLOCK)
        qp = QParams(scale, None, BLOCK, levels)
        return Packed(pack_exact(quantize(weight, qp, 4), qp, qtype).data, qtype, exact=False)
    array = weight.detach().float().numpy()
    if qtype == QType.F16:
        return Packed(array.astype(np.float16), qtype, exact=False)
    return Packed(quants.quantize(array, qtype), qtype, exact=False)


def pack_layer(codes: torch.Tensor, qp: QParams, bits: int, symmetric: bool, grid: str | None = None) -> Packed:
    """A quantized weight in the GGUF block type that suits it: exactly where its layout allows, else re-rounded."""
    qtype, exact = block_type(bits, symmetric, qp.group_size, codes.shape[1], grid)
    if exact:
        return pack_exact(codes, qp, qtype)
    return requantize(dequantize(codes, qp), qtype)


def unpack_blocks(data: np.ndarray, qtype: QType, in_features: int) -> dict[str, np.ndarray]:
    """Block bytes [out, bytes per row] -> their fields: d (fp16 [out, blocks]), m (Q4_1), q (int codes [out, in]).

    q is the signed code for Q8_0 and the nibble n in [0, 15] for Q4_0 / Q4_1 / IQ4_NL. For checks and tests."""
    out = data.shape[0]
    blocks = in_features // BLOCK
    raw = np.ascontiguousarray(data).reshape(out, blocks, -1)
    fields = {"d": raw[..., 0:2].copy().view("<f2").reshape(out, blocks)}
    if qtype == QType.Q8_0:
        fields["q"] = raw[..., 2:].copy().view(np.int8).reshape(out, in_features)
        return fields
    start = 2
    if qtype == QType.Q4_1:
        fields["m"] = raw[..., 2:4].copy().view("<f2").reshape(out, blocks)
        start = 4
    qs = raw[..., start:]
    fields["q"] = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, in_features)
    return fields
