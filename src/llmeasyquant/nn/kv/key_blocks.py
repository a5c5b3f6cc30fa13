"""Keys per channel in blocks of positions: each block of `size` positions is coded on its own per-channel range.

A calibrated range has to hold every token a channel will ever see, so its steps are wide; the keys of 32 nearby
tokens span much less of it (keys drift along a text). So the cache keeps a block's keys in full precision until
the block is complete (its positions are aligned to multiples of `size`, so prefill and token-by-token decoding
code the same blocks the same way), then codes each channel on the range of that block:

- with calibrated ranges, the values outside the calibrated range are the sparse part (kept in fp16 with their
  position; the calibration's own extremes are the thresholds, so they are rare), and the block's range of the
  dense rest is stored as two 8-bit fractions of the calibrated range (lo rounded down, hi up): 0.5 bit per key at
  32 positions instead of 1 bit for fp16 ends;
- without calibration (online) the block's own min and max are stored in fp16, and nothing is left outside.

Compact side information (`KVQuantConfig.compact`, calibrated ranges only) stores the same blocks in fewer bytes:
the range ends in `COMPACT_RANGE_BITS` bits (packed as codes are), rounded to the nearest level (with 63 levels
instead of 255, rounding outwards would widen every block's step by up to a level at each end, for the sake of the
few extreme values that rounding in clamps by less than half a level), and the kept channels coded at 8 bits on
their block's range and left out of the low-bit codes instead of fp16 beside them (their values beyond the
calibrated range join the sparse part like any other channel's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmeasyquant.primitives import MIN_SCALE, pack_bits, range_dequantize, range_quantize, unpack_bits

RANGE_CODE_LEVELS = 255  # a block's range ends are stored as uint8 fractions of the calibrated range
COMPACT_RANGE_BITS = 6  # ... or, with compact side information, in this many bits, packed
KEPT_BITS = 8  # compact: the kept channels' codes on their block's range


@dataclass
class TokenStore:
    """Named tensors [batch, heads, tokens or blocks, x], each appended along dim -2 and reordered along batch."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def append(self, **parts: torch.Tensor) -> None:
        for name, part in parts.items():
            old = self.tensors.get(name)
            self.tensors[name] = part if old is None else torch.cat((old, part), dim=-2)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self.tensors = {k: t.index_select(0, beam_idx.to(t.device)) for k, t in self.tensors.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def kept_index(kept: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kept key channels ([1, heads, 1, n]) as a gather/scatter index over x [batch, heads, tokens, dim]."""
    return kept.expand(x.shape[0], -1, x.shape[-2], -1)


def _positions(flat: torch.Tensor) -> torch.Tensor:
    """Flat key positions as stored: int32, which halves their bytes, until the cache outgrows it."""
    return flat.to(torch.int32) if not flat.numel() or int(flat.max()) < 2**31 else flat


class KeyBlocks:
    """One layer's pre-RoPE keys after the sink tokens: complete blocks coded, the incomplete one kept as is.

    `reference` is the calibrated (lo, hi) per [heads, dim], or None for ranges measured per block (online);
    `sparse` keeps the values beyond it apart (otherwise they are clamped to it).
    `first_position` is the position of the first key given (the sink count), so blocks align to positions.
    `kept` ([1, heads, 1, n] channel indices) are channels stored in fp16 for every token, or with `compact`
    (calibrated ranges only) in 8-bit codes apart from the low-bit ones, with the range ends in fewer bits.
    """

    def __init__(self, bits: int, size: int, first_position: int, levels: torch.Tensor | None = None,
                 reference: tuple[torch.Tensor, torch.Tensor] | None = None, kept: torch.Tensor | None = None,
                 sparse: bool = True, compact: bool = False):
        self.bits, self.size, self.first_position, self.levels = bits, size, first_position, levels
        self.reference = None if reference is None else (reference[0][:, None, :], reference[1][:, None, :])
        self.kept, self.sparse = kept, sparse
        self.compact = compact and reference is not None
        self.range_levels = 2**COMPACT_RANGE_BITS - 1 if self.compact else RANGE_CODE_LEVELS
        self.coded_apart = self.compact and kept is not None  # kept channels in 8-bit codes of their own
        self.rest: torch.Tensor | None = None  # coded apart: the other channels' index, built with the first keys
        self.stored = TokenStore()  # codes, block range ends, kept channels
        # Token-major flat positions, ((t * batch + b) * heads + h) * dim + d, which appending tokens leaves valid.
        self.outlier_position = torch.empty(0, dtype=torch.int32)
        self.outlier_values = torch.empty(0, dtype=torch.float16)
        self.residual: torch.Tensor | None = None  # [batch, heads, r, dim] fp32: the incomplete block
        self.coded = 0  # keys in complete blocks
        self.heads = self.dim = 0

    def append(self, keys: torch.Tensor) -> None:
        """Add pre-RoPE keys [batch, heads, tokens, dim] (fp32) and code every block they complete."""
        self.heads, self.dim = keys.shape[1], keys.shape[3]
        residual = keys if self.residual is None else torch.cat((self.residual, keys), dim=-2)
        start = self.first_position + self.coded
        end = start + residual.shape[-2]
        complete = end // self.size * self.size - start
        if complete > 0:
            head = -start % self.size  # the first block is short when the sinks do not fill part of it
            sizes = [n for n in (head, complete - head) if n]
            for blocks in residual[..., :complete, :].split(sizes, dim=-2):
                self._code(blocks)
            residual = residual[..., complete:, :]
        self.residual = residual if residual.shape[-2] else None

    def _code(self, keys: torch.Tensor) -> None:
        """Code whole blocks: keys [batch, heads, n * size, dim], or one short first block."""
        batch, heads, tokens, dim = keys.shape
        width = min(tokens, self.size)
        blocks = keys.reshape(batch, heads, tokens // width, width, dim)
        outside = torch.zeros_like(blocks, dtype=torch.bool)
        if self.reference is not None and self.sparse:
            ref_lo, ref_hi = (r[:, None] for r in self.reference)  # [heads, 1, 1, dim]
            outside = (blocks < ref_lo) | (blocks > ref_hi)
            if self.kept is not None and not self.coded_apart:  # stored exactly already
                outside &= ~self._kept_mask(blocks)
        lo = torch.where(outside, torch.inf, blocks).amin(dim=-2, keepdim=True)
        hi = torch.where(outside, -torch.inf, blocks).amax(dim=-2, keepdim=True)
        parts, lo, scale = self._store_range(lo, hi)
        codes = range_quantize(blocks, lo, scale, self.bits, self.levels).reshape(batch, heads, tokens, dim)
        if self.coded_apart:
            parts["codes"] = pack_bits(codes.gather(-1, kept_index(self._rest(), codes)), self.bits)
            index = self.kept.unsqueeze(-2).expand(batch, heads, blocks.shape[2], width, -1)
            ends = (lo.gather(-1, index[..., :1, :]), self._kept_step(scale.gather(-1, index[..., :1, :])))
            parts["kept"] = range_quantize(blocks.gather(-1, index), *ends, KEPT_BITS).reshape(batch, heads, tokens, -1)
        else:
            parts["codes"] = pack_bits(codes, self.bits)
            if self.kept is not None:
                parts["kept"] = keys.gather(-1, kept_index(self.kept, keys)).half()
        self.stored.append(**parts)
        if bool(outside.any()):
            self._add_outliers(outside.reshape(keys.shape), keys)
        self.coded += tokens

    def _store_range(self, lo: torch.Tensor, hi: torch.Tensor
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """What is stored of block ranges [batch, heads, blocks, 1, dim], and the (lo, scale) it decodes to."""
        if self.reference is None:
            lo16 = lo.half()
            scale16 = ((hi - lo16.float()) / (2**self.bits - 1)).clamp(min=MIN_SCALE).half()
            parts = {"range_lo": lo16.squeeze(-2), "range_scale": scale16.squeeze(-2)}
        else:
            ref_lo, fraction = self._fraction()
            empty = lo > hi  # every value of the channel lies outside the calibrated range
            lo_code, hi_code = (lo - ref_lo[:, None]) / fraction[:, None], (hi - ref_lo[:, None]) / fraction[:, None]
            outwards = not self.compact  # the module docstring says why compact ends round to the nearest level
            lo_code = (lo_code.floor() if outwards else lo_code.round()).clamp(0, self.range_levels)
            hi_code = (hi_code.ceil() if outwards else hi_code.round()).clamp(0, self.range_levels)
            hi_code = torch.where(empty, lo_code, hi_code)
            parts = {name: code.to(torch.uint8).squeeze(-2) for name, code in (("range_lo", lo_code),
                                                                                ("range_hi", hi_code))}
            if self.compact:
                parts = {name: pack_bits(code, COMPACT_RANGE_BITS) for name, code in parts.items()}
        lo, scale = self._decode_range(parts)
        return parts, lo[..., None, :], scale[..., None, :]

    def _fraction(self) -> tuple[torch.Tensor, torch.Tensor]:
        ref_lo, ref_hi = self.reference
        return ref_lo, (ref_hi - ref_lo) / self.range_levels

    def _decode_range(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, scale) [batch, heads, blocks, dim] in fp32 from what is stored."""
        if self.reference is None:
            return parts["range_lo"].float(), parts["range_scale"].float()
        ref_lo, fraction = self._fraction()
        lo_code, hi_code = parts["range_lo"], parts["range_hi"]
        if self.compact:
            lo_code, hi_code = (unpack_bits(code, COMPACT_RANGE_BITS, self.dim) for code in (lo_code, hi_code))
        lo = ref_lo + lo_code.float() * fraction
        hi = ref_lo + hi_code.float() * fraction
        return lo, ((hi - lo) / (2**self.bits - 1)).clamp(min=MIN_SCALE)

    def _add_outliers(self, outside: torch.Tensor, keys: torch.Tensor) -> None:
        batch, heads, _, dim = keys.shape
        b, h, t, d = outside.nonzero(as_tuple=True)
        position = (((t + self.coded) * batch + b) * heads + h) * dim + d
        # Token-major: the new positions are the largest so far, so if they fit int32 the stored ones do too.
        position = _positions(position)
        self.outlier_position = torch.cat((self.outlier_position.to(keys.device, position.dtype), position))
        self.outlier_values = torch.cat((self.outlier_values.to(keys.device), keys[b, h, t, d].half()))

    def _kept_step(self, scale: torch.Tensor) -> torch.Tensor:
        """The step of the kept channels' 8-bit codes on a block range whose low-bit step is `scale`."""
        return scale * ((2**self.bits - 1) / (2**KEPT_BITS - 1))

    def _rest(self) -> torch.Tensor:
        """The channels in the low-bit codes when the kept ones are coded apart: [1, heads, 1, dim - n], ascending
        (built once: every read of the cache needs it)."""
        if self.rest is None:
            mask = torch.ones(self.kept.shape[1], self.dim, dtype=torch.bool, device=self.kept.device)
            mask.scatter_(-1, self.kept[0, :, 0], False)
            self.rest = mask.nonzero()[:, 1].reshape(1, self.kept.shape[1], 1, -1)
        return self.rest

    def _kept_mask(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(x.shape[1], x.shape[-1], dtype=torch.bool, device=x.device)
        mask.scatter_(-1, self.kept[0, :, 0], True)  # [heads, dim]
        return mask.reshape(1, x.shape[1], *([1] * (x.dim() - 3)), x.shape[-1])

    def read(self, out: torch.Tensor) -> None:
        """Write all keys given so far, pre-RoPE, into out (fp32 [batch, heads, tokens, dim]): blocks decoded, the
        residual as is."""
        if self.coded:
            self._decode(out[..., : self.coded, :])
        if self.residual is not None:
            out[..., self.coded:, :] = self.residual

    @torch.no_grad()  # decoded from integer codes: nothing to differentiate, and `out=` refuses autograd
    def _decode(self, x: torch.Tensor) -> None:
        tensors = self.stored.tensors
        lo, scale = self._decode_range(tensors)  # [batch, heads, blocks, dim]
        if self.coded_apart:
            rest = self._rest()
            part = unpack_bits(tensors["codes"], self.bits, rest.shape[-1])
            codes = torch.zeros(*part.shape[:-1], self.dim, dtype=torch.uint8, device=part.device)
            codes.scatter_(-1, kept_index(rest, codes), part)
        else:
            codes = unpack_bits(tensors["codes"], self.bits, self.dim)
        self._decode_blocks(codes, lo, scale, self.bits, self.levels, x)
        if self.kept is not None:
            kept = tensors["kept"]
            if self.coded_apart:
                index = self.kept.expand(*lo.shape[:-1], -1)
                decoded = torch.empty(kept.shape, device=x.device)
                self._decode_blocks(kept, lo.gather(-1, index), self._kept_step(scale.gather(-1, index)), KEPT_BITS,
                                    None, decoded)
                kept = decoded
            x.scatter_(-1, kept_index(self.kept, x), kept.float())
        if self.outlier_position.numel():  # after the kept channels: with compact they have sparse values too
            batch, heads, _, dim = x.shape
            position = self.outlier_position.long()
            rest, d = position.div(dim, rounding_mode="floor"), position % dim
            rest, h = rest.div(heads, rounding_mode="floor"), rest % heads
            t, b = rest.div(batch, rounding_mode="floor"), rest % batch
            x.index_put_((b, h, t, d), self.outlier_values.float())

    def _decode_blocks(self, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                       levels: torch.Tensor | None, x: torch.Tensor) -> None:
        """Decode codes [batch, heads, tokens, n] on their blocks' (lo, scale) [batch, heads, blocks, n] into x, in
        place block by block (a view splitting tokens into blocks), not with ranges gathered per token."""
        tokens = codes.shape[-2]
        head = min(-self.first_position % self.size, tokens)  # the short first block, if any
        if head:
            x[..., :head, :] = range_dequantize(codes[..., :head, :], lo[..., :1, :], scale[..., :1, :], bits, levels)
        whole = x[..., head:, :].unflatten(-2, (-1, self.size))
        first = 1 if head else 0
        range_dequantize(codes[..., head:, :].unflatten(-2, (-1, self.size)), lo[..., first:, None, :],
                         scale[..., first:, None, :], bits, levels, out=whole)

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by part: codes, scales (the block ranges), outliers, kept_channels, residual."""
        kinds = {"codes": "codes", "kept": "kept_channels"}
        out: dict[str, int] = {}
        for name, tensor in self.stored.tensors.items():
            part = kinds.get(name, "scales")
            out[part] = out.get(part, 0) + tensor.numel() * tensor.element_size()
        out["outliers"] = sum(t.numel() * t.element_size() for t in (self.outlier_position, self.outlier_values))
        out["residual"] = 0 if self.residual is None else self.residual.numel() * self.residual.element_size()
        return out

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch for beam search: new row i is old row beam_idx[i]."""
        beam_idx = beam_idx.to(self.outlier_position.device)
        positions = self.outlier_position.long()
        old_batch = next(iter(self.stored.tensors.values())).shape[0] if self.stored.tensors else None
        self.stored.reorder(beam_idx)
        if self.residual is not None:
            self.residual = self.residual.index_select(0, beam_idx.to(self.residual.device))
        if self.outlier_position.numel() and old_batch is not None:
            per_token = old_batch * self.heads * self.dim
            t, rest = positions.div(per_token, rounding_mode="floor"), positions % per_token
            b, hd = rest.div(self.heads * self.dim, rounding_mode="floor"), rest % (self.heads * self.dim)
            new_row, which = (b[None, :] == beam_idx[:, None]).nonzero(as_tuple=True)
            new_batch = beam_idx.shape[0]
            self.outlier_position = _positions((t[which] * new_batch + new_row) * self.heads * self.dim + hd[which])
            self.outlier_values = self.outlier_values[which]
