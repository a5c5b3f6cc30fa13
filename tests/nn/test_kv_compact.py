"""Compact side information of the quantized KV cache (`KVQuantConfig(compact=True)`): block range ends in 6 bits,
kept key channels in 8-bit codes apart from the low-bit ones, value outliers in int8 steps, searched value ranges."""

from __future__ import annotations

import pytest
import torch
from tests.nn.test_kv_cache import DIM, HEADS, drifting_keys, flat_ranges, gen, kv

import llmeasyquant as lq
from llmeasyquant.errors import ConfigError
from llmeasyquant.nn.kv.coding import OUTLIER_STEPS, code_per_token, decode_store
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.nn.kv.key_blocks import COMPACT_RANGE_BITS
from llmeasyquant.nn.kv.layout import QuantizedKVLayer
from llmeasyquant.primitives import unpack_bits


@pytest.mark.parametrize("options", [{"key_block": 0}, {"key_axis": "token"}])
def test_compact_needs_key_blocks(options: dict) -> None:
    with pytest.raises(ConfigError, match="compact KV side information codes keys per channel in blocks"):
        KVQuantConfig(3, 3, compact=True, **options)
    assert KVQuantConfig(3, 3, compact=True).name.endswith("-compact")
    assert KVQuantConfig.from_dict(KVQuantConfig(3, 3, compact=True).to_dict()).compact


def _values(tokens: int = 64, outlier_scale: float = 6.0) -> torch.Tensor:
    x = torch.randn(1, HEADS, tokens, DIM, generator=gen(5))
    x[..., 3] *= outlier_scale  # one channel of large values: the outliers
    return x


def _decoded(parts: dict[str, torch.Tensor], bits: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    decode_store(parts, bits, None, None, None, out)
    return out


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_compact_value_ranges_round_no_worse_than_min_max(bits: int) -> None:
    """Min-max is one of the searched ranges, so no vector's dense part rounds worse; some round better."""
    x = _values()
    plain, compact = code_per_token(x, bits, None, 2), code_per_token(x, bits, None, 2, compact=True)
    assert torch.equal(plain["outlier_index"], compact["outlier_index"])
    dense = torch.ones_like(x, dtype=torch.bool).scatter_(-1, plain["outlier_index"].long(), False)
    errors = [((_decoded(parts, bits, x) - x) * dense).square().sum(-1) for parts in (plain, compact)]
    assert bool((errors[1] <= errors[0]).all()) and (errors[1] < errors[0]).float().mean() > 0.2


def test_compact_value_outliers_are_int8_steps_of_the_token_grid() -> None:
    bits = 3
    x = _values()
    parts = code_per_token(x, bits, None, 2, compact=True)
    assert parts["outlier_values"].dtype == torch.int8
    back = _decoded(parts, bits, x)
    index = parts["outlier_index"].long()
    step = parts["scale"].float()
    error = (back.gather(-1, index) - x.gather(-1, index)).abs()
    assert bool((error <= step / 2 * 1.001 + 1e-6).all())  # within half a step: none is beyond 127 steps here
    far = x.clone()
    far[0, 0, 0, 0] = 1e4  # far beyond 127 steps of its token's grid: held at the last step
    parts = code_per_token(far, bits, None, 2, compact=True)
    assert int(parts["outlier_values"][0, 0, 0].max()) == OUTLIER_STEPS[1]
    assert (_decoded(parts, bits, far)[0, 0, 0, 0] - far[0, 0, 0, 0]).abs() > 1e3


def test_compact_key_blocks_code_kept_channels_apart_in_eight_bits() -> None:
    bits, block, kept = 3, 8, 8
    keys = drifting_keys(4, block)
    lo, hi = keys.amin(dim=(0, 2)), keys.amax(dim=(0, 2))
    ranges = (lo, hi, torch.arange(kept).repeat(HEADS, 1))
    config = KVQuantConfig(bits, 8, outliers=0.0, sinks=0, key_block=block, key_channels=kept)
    plain = QuantizedKVLayer(config, ranges)
    compact = QuantizedKVLayer(KVQuantConfig(**config.to_dict() | {"compact": True}), ranges)
    k_plain, k_compact = plain.update(keys, keys)[0], compact.update(keys, keys)[0]
    stored = compact.key_blocks.stored.tensors
    assert stored["kept"].dtype == torch.uint8 and stored["kept"].shape[-1] == kept
    assert stored["range_hi"].shape[-1] == DIM * COMPACT_RANGE_BITS // 8  # packed, not a byte each
    assert int(unpack_bits(stored["range_hi"], COMPACT_RANGE_BITS, DIM).max()) <= 2**COMPACT_RANGE_BITS - 1
    # The kept channels: within half an 8-bit step of their block's (6-bit) range, plus the ends' rounding.
    per_block = keys.reshape(1, HEADS, 4, block, DIM)
    level = (hi - lo)[:, None] / (2**COMPACT_RANGE_BITS - 1)
    span = per_block.amax(dim=3) - per_block.amin(dim=3) + level
    for width, channels in ((255, slice(None, kept)), (2**bits - 1, slice(kept, None))):
        bound = (span / width / 2 + level / 2) * 1.01 + 1e-6
        error = (k_compact - keys).abs()[..., channels]
        assert bool((error <= bound.repeat_interleave(block, dim=2)[..., channels]).all())
    assert torch.equal(k_plain[..., :kept], keys[..., :kept].half().float())  # fp16 without compact
    plain_bytes, compact_bytes = plain.nbytes(), compact.nbytes()
    assert compact_bytes["kept_channels"] == plain_bytes["kept_channels"] // 2  # a byte a value, not two
    assert compact_bytes["codes"] < plain_bytes["codes"]  # the kept channels are not in the low-bit codes
    # Two 6-bit range ends per (head, block, channel); the values' zero points and steps as before.
    assert compact_bytes["scales"] == 2 * HEADS * 4 * DIM * COMPACT_RANGE_BITS // 8 + 3 * HEADS * 32


def test_compact_key_values_beyond_the_calibrated_range_stay_exact_in_kept_channels() -> None:
    keys, values = kv(32)
    keys = keys.clamp(-1, 1)
    keys[0, 1, 5, 0] = 30.0  # channel 0 is kept
    config = KVQuantConfig(4, 4, sinks=0, key_block=16, key_channels=2, compact=True)
    back = QuantizedKVLayer(config, flat_ranges(-1, 1, kept=2)).update(keys, values)[0]
    assert back[0, 1, 5, 0] == 30.0


def test_compact_keys_decode_token_by_token_as_in_prefill() -> None:
    keys, values = kv(45)
    keys[0, 0, 20, 1] = 9.0
    config = KVQuantConfig(3, 3, sinks=3, key_block=8, key_channels=2, compact=True)
    prefill = QuantizedKVLayer(config, flat_ranges(-2, 2, kept=2))
    k_prefill, v_prefill = prefill.update(keys, values)
    stepwise = QuantizedKVLayer(config, flat_ranges(-2, 2, kept=2))
    for t in range(45):
        k_step, v_step = stepwise.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])
    assert torch.equal(k_step, k_prefill) and torch.equal(v_step, v_prefill)


def test_compact_cache_on_a_model_holds_fewer_bytes_and_stays_close(tiny_llama, random_ids) -> None:
    spec = lq.SimQuant(KVQuantConfig(3, 3, key_block=8, key_channels=8), samples=2).calibrate(
        tiny_llama, random_ids, progress=False)
    compact = lq.KVCacheSpec(KVQuantConfig(**spec.config.to_dict() | {"compact": True}), spec.key_ranges)
    ids = random_ids[:1]
    with torch.no_grad():
        exact = tiny_llama(ids).logits
        runs = {}
        for name, which in (("plain", spec), ("compact", compact), ("again", compact)):
            cache = which.new_cache(tiny_llama)
            runs[name] = (tiny_llama(ids, past_key_values=cache, use_cache=True).logits, cache.nbytes()["total"])
    assert runs["compact"][1] < runs["plain"][1]
    assert torch.equal(runs["compact"][0], runs["again"][0])  # the same inputs code the same bits
    for name in ("plain", "compact"):
        assert (runs[name][0] - exact).abs().max() < 0.5 * exact.abs().max()
