"""SimQuant's quantized KV cache: packing, round trips per bit width, outliers, sinks, RoPE order, online ranges,
generate() integration and checkpoints, on random tensors and the tiny models."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tests.models.test_arch import tiny
from transformers.cache_utils import DynamicCache

import llmeasyquant as lq
from llmeasyquant.errors import CheckpointError, ConfigError
from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
from llmeasyquant.models.arch import apply_rope
from llmeasyquant.nn.kv.cache import QuantizedKVCache
from llmeasyquant.nn.kv.calibration import KeyRanges
from llmeasyquant.nn.kv.coding import apply_rope_, undo_rope
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.nn.kv.key_blocks import _positions
from llmeasyquant.nn.kv.layout import QuantizedKVLayer
from llmeasyquant.primitives import normal_float_levels, pack_bits, range_dequantize, range_quantize, unpack_bits

HEADS, DIM = 2, 16


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    return torch.randn(1, HEADS, tokens, DIM, generator=g), torch.randn(1, HEADS, tokens, DIM, generator=g)


def flat_ranges(lo: float = -4.0, hi: float = 4.0, kept: int = 0) -> tuple[torch.Tensor, ...]:
    return (torch.full((HEADS, DIM), lo), torch.full((HEADS, DIM), hi),
            torch.arange(kept).repeat(HEADS, 1) if kept else torch.zeros(HEADS, 0, dtype=torch.int64))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 8, 13, 64])
def test_pack_bits_round_trips_and_really_shrinks(bits: int, n: int) -> None:
    codes = torch.randint(0, 2**bits, (3, 5, n), generator=gen(bits), dtype=torch.int64).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (n if bits == 8 else math.ceil(n / 8) * bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_bits_layout_is_fixed() -> None:
    """Checkpoints store packed weights: each run of 8 codes fills `bits` bytes, least significant bits first."""
    assert pack_bits(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.uint8), 4).tolist() == [0x21, 0x43, 0x65, 0x87]
    assert pack_bits(torch.tensor([1, 2, 3, 0, 3, 2, 1, 0], dtype=torch.uint8), 2).tolist() == [0x39, 0x1B]
    assert pack_bits(torch.tensor([7, 1, 0, 0, 0, 0, 0, 5], dtype=torch.uint8), 3).tolist() == [0x0F, 0x00, 0xA0]


def test_uniform_and_normal_float_levels() -> None:
    levels = normal_float_levels(3)
    assert levels[0] == 0 and levels[-1] == 1 and bool((levels.diff() > 0).all())
    assert levels[4] - levels[3] < levels[1] - levels[0]  # dense in the middle
    x = torch.linspace(-1, 1, 101)
    lo, scale = torch.tensor(-1.0), torch.tensor(2 / 7)
    for lv in (None, levels):
        back = range_dequantize(range_quantize(x, lo, scale, 3, lv), lo, scale, 3, lv)
        assert (back - x).abs().max() <= (0.5 if lv is not None else 1 / 7) + 1e-6


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_error_is_within_half_a_step(bits: int) -> None:
    """Keys on a calibrated range [-4, 4] and per-token values: max error within half a step (plus fp16 slack)."""
    keys, values = kv(64)
    keys = keys.clamp(-4, 4)
    layer = QuantizedKVLayer(KVQuantConfig(bits, bits, outliers=0.0, sinks=0, key_margin=1.0, key_block=0),
                             flat_ranges())
    k_back, v_back = layer.update(keys, values)
    step_k = 8 / (2**bits - 1)
    assert (k_back - keys).abs().max() <= step_k / 2 * 1.01
    v_step = (values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)) / (2**bits - 1)
    assert bool(((v_back - values).abs() <= v_step / 2 * 1.01 + 1e-3).all())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_value_zero_points_fit_a_byte_and_hold_ranges_off_zero(bits: int) -> None:
    """Values are coded on a range widened to hold 0, with where 0 lies on the grid in one byte: a vector that
    does not straddle 0 still comes back within half a step of [0, max]."""
    _, values = kv(32)
    values[0, 0] = values[0, 0].abs() + 3.0  # every value positive
    layer = QuantizedKVLayer(KVQuantConfig(8, bits, outliers=0.0, sinks=0, key_block=0), flat_ranges())
    back = layer.update(values, values)[1]
    assert layer.value_store.tensors["zero"].dtype == torch.uint8
    span = values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True).clamp(max=0)
    assert bool(((back - values).abs() <= span / (2**bits - 1) / 2 * 1.01 + 1e-3).all())


def test_round_trip_error_shrinks_with_bits() -> None:
    keys, values = kv(64)
    errors = []
    for bits in (2, 3, 4, 8):
        layer = QuantizedKVLayer(KVQuantConfig(bits, bits), flat_ranges())
        k_back, v_back = layer.update(keys, values)
        errors.append(float((k_back - keys).pow(2).mean() + (v_back - values).pow(2).mean()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 1000


def test_eight_bit_keys_get_headroom_beyond_the_calibrated_range() -> None:
    keys, values = kv(8)
    keys = keys.clamp(-1, 1) * 1.8  # beyond the calibrated [-1, 1]
    eight = QuantizedKVLayer(KVQuantConfig(8, 8, outliers=0.0, sinks=0, key_block=0), flat_ranges(-1, 1))
    four = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.0, sinks=0, key_block=0), flat_ranges(-1, 1))
    assert (eight.update(keys, values)[0] - keys).abs().max() < 2 / 255  # 2x range: a step of 4/255, no clamping
    assert four.update(keys, values)[0].abs().max() <= 1.01  # 4 bits: coded on the calibrated range itself
    with pytest.raises(ConfigError, match="key_margin"):
        KVQuantConfig(key_margin=0.5)


def test_outliers_are_kept_exactly_and_tighten_the_dense_range() -> None:
    _, values = kv(32)
    values[0, 0, :, 3] = 50.0  # one huge value per vector
    with_out = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.05, sinks=0), flat_ranges())
    without = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.0, sinks=0), flat_ranges())
    _, v_with = with_out.update(torch.zeros_like(values), values)
    _, v_without = without.update(torch.zeros_like(values), values)
    assert torch.equal(v_with[0, 0, :, 3], values[0, 0, :, 3])  # 50 fits fp16 exactly
    rest = [c for c in range(DIM) if c != 3]
    err_with = (v_with - values)[0, 0][:, rest].abs().mean()
    err_without = (v_without - values)[0, 0][:, rest].abs().mean()
    assert err_with < err_without / 5


def test_value_outliers_are_the_ones_that_narrow_the_range_most() -> None:
    values = torch.zeros(1, HEADS, 1, DIM)
    values[..., :4] = torch.tensor([1.0, 0.95, -0.9, -0.1])  # the top is furthest out, the bottom stands apart
    layer = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.05, sinks=0, key_block=0), flat_ranges())
    layer.update(torch.zeros_like(values), values)
    assert layer.value_store.tensors["outlier_index"].flatten().tolist() == [2] * HEADS  # span 1.1, not 1.85
    two = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.1, sinks=0, key_block=0), flat_ranges())
    two.update(torch.zeros_like(values), values)
    assert two.value_store.tensors["outlier_index"].sort(dim=-1).values.flatten().tolist() == [0, 1] * HEADS


def test_key_outliers_beyond_the_calibrated_range_survive() -> None:
    keys, values = kv(16)
    keys = keys.clamp(-1, 1)
    keys[0, 1, 5, 7] = 30.0
    clamped = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.0, sinks=0, key_block=0), flat_ranges(-1, 1))
    sparse = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.05, sinks=0, key_block=0), flat_ranges(-1, 1))
    assert clamped.update(keys, values)[0][0, 1, 5, 7] == pytest.approx(1.0, abs=1e-2)
    assert sparse.update(keys, values)[0][0, 1, 5, 7] == 30.0


def drifting_keys(blocks: int, size: int, seed: int = 0) -> torch.Tensor:
    """Keys whose channels drift from block to block: each block spans a small part of the whole range."""
    g = gen(seed)
    centres = torch.randn(1, HEADS, blocks, 1, DIM, generator=g) * 3
    noise = torch.randn(1, HEADS, blocks, size, DIM, generator=g) * 0.3
    return (centres + noise).reshape(1, HEADS, blocks * size, DIM)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_key_blocks_code_each_block_on_its_own_range(bits: int) -> None:
    keys = drifting_keys(4, 8)
    lo, hi = keys.amin(dim=(0, 2)), keys.amax(dim=(0, 2))
    ranges = (lo, hi, torch.zeros(HEADS, 0, dtype=torch.int64))
    blocks = QuantizedKVLayer(KVQuantConfig(bits, 8, outliers=0.0, sinks=0, key_block=8), ranges)
    whole = QuantizedKVLayer(KVQuantConfig(bits, 8, outliers=0.0, sinks=0, key_block=0, key_margin=1.0), ranges)
    k_blocks, k_whole = blocks.update(keys, keys)[0], whole.update(keys, keys)[0]
    # Within half a step of the block's range, its ends rounded outwards to 1/255 of the calibrated range.
    per_block = keys.reshape(1, HEADS, 4, 8, DIM)
    span = per_block.amax(dim=3) - per_block.amin(dim=3) + 2 * (hi - lo)[:, None] / 255
    bound = (span / (2**bits - 1) / 2 * 1.01 + 1e-6).repeat_interleave(8, dim=2)
    assert bool(((k_blocks - keys).abs() <= bound).all())
    assert (k_blocks - keys).pow(2).mean() < (k_whole - keys).pow(2).mean() / 4
    sizes = blocks.nbytes()
    # Two uint8 range ends per (head, block, channel) for the keys; a uint8 zero point and an fp16 step per
    # (head, token) for the values.
    assert sizes["scales"] == 2 * HEADS * 4 * DIM + 3 * HEADS * 32
    assert sizes["residual"] == 0 and sizes["outliers"] == 0


def test_key_blocks_align_to_positions_and_decode_token_by_token_as_in_prefill() -> None:
    keys, values = kv(45)
    config = KVQuantConfig(4, 4, sinks=3, key_block=8)
    prefill = QuantizedKVLayer(config, flat_ranges(-2, 2))
    k_prefill, _ = prefill.update(keys, values)
    stepwise = QuantizedKVLayer(config, flat_ranges(-2, 2))
    for t in range(45):
        k_step, _ = stepwise.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])
    assert torch.equal(k_step, k_prefill)
    # Blocks cover positions 3-7, 8-15, ..., 32-39; the sinks (0-2) and the incomplete block (40-44) stay exact.
    assert prefill.key_blocks.coded == 37 and prefill.nbytes()["residual"] == 5 * HEADS * DIM * 4
    assert torch.equal(k_prefill[..., :3, :], keys[..., :3, :].half().float())
    assert torch.allclose(k_prefill[..., 40:, :], keys[..., 40:, :])
    assert not torch.allclose(k_prefill[..., 3:40, :], keys[..., 3:40, :])


def test_key_blocks_keep_values_beyond_the_calibrated_range_exactly() -> None:
    keys, values = kv(32)
    keys = keys.clamp(-1, 1)
    keys[0, 1, 5, 7], keys[0, 0, 20, 2] = 30.0, -12.5
    layer = QuantizedKVLayer(KVQuantConfig(4, 4, sinks=0, key_block=16), flat_ranges(-1, 1))
    back = layer.update(keys, values)[0]
    assert back[0, 1, 5, 7] == 30.0 and back[0, 0, 20, 2] == -12.5
    rest = (back - keys).abs()
    rest[0, 1, 5, 7] = rest[0, 0, 20, 2] = 0
    assert rest.max() <= 2 / 15 / 2 * 1.01  # the others: within half a step of [-1, 1] at most
    assert layer.key_blocks.nbytes()["outliers"] == 2 * (4 + 2)  # a position (int32) and an fp16 value each
    clamped = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.0, sinks=0, key_block=16), flat_ranges(-1, 1))
    back = clamped.update(keys, values)[0]
    assert back[0, 1, 5, 7] == pytest.approx(1.0, abs=1e-2) and clamped.nbytes()["outliers"] == 0


def test_sparse_key_positions_widen_to_int64_only_when_they_must() -> None:
    assert _positions(torch.tensor([0, 2**31 - 1])).dtype == torch.int32
    assert _positions(torch.tensor([0, 2**31])).dtype == torch.int64


def test_key_blocks_follow_beam_reordering() -> None:
    g = gen(3)
    keys, values = torch.randn(2, HEADS, 20, DIM, generator=g), torch.randn(2, HEADS, 20, DIM, generator=g)
    keys[1, 0, 4, 5], keys[0, 1, 9, 0] = 40.0, -40.0
    layer = QuantizedKVLayer(KVQuantConfig(4, 4, sinks=0, key_block=8), flat_ranges())
    before = layer.update(keys, values)[0]
    beams = torch.tensor([1, 1, 0])
    layer.reorder_cache(beams)
    after = layer._keys()
    assert torch.equal(after, before[beams])
    assert after[0, 0, 4, 5] == 40.0 and after[2, 1, 9, 0] == -40.0


def test_online_key_blocks_store_fp16_ranges_and_no_outliers() -> None:
    keys = drifting_keys(2, 8)
    layer = QuantizedKVLayer(KVQuantConfig(8, 8, outliers=0.0, sinks=0, key_block=8))
    back = layer.update(keys, keys)[0]
    assert (back - keys).abs().max() < 0.02
    assert layer.key_blocks.stored.tensors["range_lo"].dtype == torch.float16 and layer.nbytes()["outliers"] == 0


def test_sinks_are_exact_and_only_the_first_tokens() -> None:
    """Sinks are stored in 16 bits: exact for a 16-bit model, fp16-rounded for an fp32 one."""
    keys, values = kv(20)
    keys16, values16 = keys.half().float(), values.half().float()
    layer = QuantizedKVLayer(KVQuantConfig(2, 2, sinks=3), flat_ranges())
    k_back, v_back = layer.update(keys[..., :2, :], values[..., :2, :])  # two sinks arrive first ...
    assert torch.equal(k_back, keys16[..., :2, :]) and torch.equal(v_back, values16[..., :2, :])
    k_back, v_back = layer.update(keys[..., 2:, :], values[..., 2:, :])  # ... then the third, then the rest
    assert torch.equal(k_back[..., :3, :], keys16[..., :3, :]) and torch.equal(v_back[..., :3, :],
                                                                                values16[..., :3, :])
    assert layer.nbytes()["sinks"] == 2 * 3 * HEADS * DIM * 2
    bf16 = QuantizedKVLayer(KVQuantConfig(2, 2, sinks=3), flat_ranges())
    k_back, _ = bf16.update(keys.bfloat16(), values.bfloat16())
    assert k_back.dtype == torch.bfloat16 and torch.equal(k_back[..., :3, :], keys[..., :3, :].bfloat16())
    assert not torch.equal(v_back[..., 3:, :], values[..., 3:, :])
    assert layer.get_seq_length() == 20 and k_back.shape == keys.shape


def test_kept_key_channels_are_exact() -> None:
    keys, values = kv(16)
    for block in (0, 8):
        layer = QuantizedKVLayer(KVQuantConfig(2, 2, sinks=0, outliers=0.0, key_channels=2, key_block=block),
                                 flat_ranges(kept=2))
        k_back, _ = layer.update(keys * 3, values)
        assert torch.equal(k_back[..., :2], (keys * 3)[..., :2].half().float())
        assert not torch.equal(k_back[..., 2:], (keys * 3)[..., 2:])
        assert layer.nbytes()["kept_channels"] == 2 * HEADS * 16 * 2


def _rope(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    freqs = torch.arange(tokens).float()[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_undo_rope_inverts_apply_rope() -> None:
    x = torch.randn(3, 10, DIM, generator=gen())
    cos, sin = _rope(10)
    assert torch.allclose(undo_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5)
    assert torch.allclose(undo_rope(apply_rope(x, 2 * cos, 2 * sin), 2 * cos, 2 * sin), x, atol=1e-5)
    in_place = x.clone()
    apply_rope_(in_place, cos, sin)
    assert torch.equal(in_place, apply_rope(x, cos, sin))  # the cache's in-place rotation: the same bits


def test_keys_are_quantized_before_rope_and_rotated_after() -> None:
    """Fixed per-channel ranges fit pre-RoPE keys with a constant channel offset: quantized before rotation they
    come back close; quantized after rotation (the offset smeared over positions) they clamp badly."""
    tokens = 48
    cos, sin = _rope(tokens)
    pre = torch.randn(1, HEADS, tokens, DIM, generator=gen()) * 0.1 + 2.0  # all channels near 2
    post = apply_rope(pre, cos, sin)
    table = _rope(tokens)

    def rope(first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return table[0][first:end], table[1][first:end]

    lo, hi = pre.amin(dim=(0, 2)), pre.amax(dim=(0, 2))
    ranges = (lo, hi, torch.zeros(HEADS, 0, dtype=torch.int64))
    before = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.0, sinks=0, key_block=0), ranges, rope)
    after = QuantizedKVLayer(KVQuantConfig(4, 4, outliers=0.0, sinks=0, pre_rope=False, key_block=0), ranges, rope)
    k_before, _ = before.update(post, post)
    k_after, _ = after.update(post, post)
    assert (k_before - post).abs().max() < 0.05
    assert (k_after - post).abs().max() > 1.0


def test_online_ranges_follow_the_keys_with_an_ema() -> None:
    keys, values = kv(4)
    layer = QuantizedKVLayer(KVQuantConfig(8, 8, outliers=0.0, sinks=0, momentum=0.5, segment=2, key_block=0))
    layer.update(keys, values)
    assert len(layer.segments) == 2  # the 4 tokens split into segments of 2, each with a range snapshot
    big = torch.full((1, HEADS, 2, DIM), 10.0)
    layer.update(big, big)
    assert layer.observer.hi.min() > 4.0  # pulled half-way towards 10
    assert len(layer.segments) == 3


@pytest.fixture
def calibrated(tiny_llama, random_ids):
    spec = lq.SimQuant(KVQuantConfig(8, 8), samples=2).calibrate(tiny_llama, random_ids, progress=False)
    return tiny_llama, spec


def test_calibration_gives_per_layer_per_channel_ranges(calibrated, random_ids) -> None:
    model, spec = calibrated
    assert len(spec.key_ranges.lo) == 2
    assert spec.key_ranges.lo[0].shape == (2, 16) and bool((spec.key_ranges.lo[0] <= spec.key_ranges.hi[0]).all())
    again = lq.SimQuant(KVQuantConfig(8, 8), samples=2).calibrate(model, random_ids, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(spec.key_ranges.lo, again.key_ranges.lo, strict=True))


def test_sensitive_key_channels_are_chosen_per_head(tiny_llama, random_ids) -> None:
    spec = lq.SimQuant(KVQuantConfig(4, 4, key_channels=3)).calibrate(tiny_llama, random_ids, progress=False)
    kept = spec.key_ranges.kept[0]
    assert kept.shape == (2, 3) and bool((kept.diff(dim=-1) > 0).all())


def test_generate_with_the_quantized_cache(calibrated, random_ids) -> None:
    model, spec = calibrated
    prompt = random_ids[:1, :8]
    options = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
    plain = model.generate(prompt, **options)
    cache = spec.new_cache(model)
    assert isinstance(cache, QuantizedKVCache)
    quant = model.generate(prompt, past_key_values=cache, **options)
    assert torch.equal(quant, plain)  # 8 bits: the same greedy tokens
    assert cache.get_seq_length() == 8 + 16 - 1
    rough = model.generate(prompt, past_key_values=lq.SimQuant(KVQuantConfig(2, 2, sinks=0)).calibrate(
        model, random_ids, progress=False).new_cache(model), **options)
    assert rough.shape == plain.shape


def test_quantized_cache_changes_logits_a_little_and_memory_a_lot(calibrated, random_ids) -> None:
    model, spec = calibrated
    ids = random_ids[:1]
    ref = model(ids).logits
    cache = spec.new_cache(model)
    out = model(ids, past_key_values=cache, use_cache=True).logits
    assert 0 < (out - ref).abs().max() < 0.05
    four = lq.SimQuant(KVQuantConfig(4, 4)).calibrate(model, random_ids, progress=False).new_cache(model)
    model(ids, past_key_values=four, use_cache=True)
    plain = DynamicCache(config=model.config)
    model(ids, past_key_values=plain, use_cache=True)
    assert four.fp16_bytes() == sum(2 * t.numel() for layer in plain.layers for t in (layer.keys, layer.values))
    assert four.nbytes()["total"] < cache.nbytes()["total"] < four.fp16_bytes()


def test_evaluation_runs_windows_through_the_cache(calibrated, tiny_tokenizer, wiki_text) -> None:
    from llmeasyquant.calibration.data import read_text_file

    model, spec = calibrated
    windows = make_windows(tiny_tokenizer, read_text_file(wiki_text), seqlen=32, max_windows=3)
    two = lq.SimQuant(KVQuantConfig(2, 2, sinks=0)).calibrate(model, windows.ids, progress=False)
    metrics = evaluate_windows({"fp": model, "k8": model, "k2": model}, windows, reference="fp", progress=False,
                               caches={"k8": lambda: spec.new_cache(model), "k2": lambda: two.new_cache(model)})
    assert 0 < metrics["k8"]["kld"] < metrics["k2"]["kld"]


def test_gpt2_without_rope_works(tiny_gpt2, random_ids) -> None:
    spec = lq.SimQuant(KVQuantConfig(8, 8)).calibrate(tiny_gpt2, random_ids, progress=False)
    ref = tiny_gpt2(random_ids[:1]).logits
    out = tiny_gpt2(random_ids[:1], past_key_values=spec.new_cache(tiny_gpt2), use_cache=True).logits
    assert (out - ref).abs().max() < 0.05


def test_gpt2_keeps_key_channels_chosen_from_its_fused_queries(tiny_gpt2, random_ids) -> None:
    config = KVQuantConfig(3, 3)  # 3 bits keep 2 key channels per head by default
    spec = lq.SimQuant(config).calibrate(tiny_gpt2, random_ids, progress=False)
    hidden, heads = tiny_gpt2.config.n_embd, tiny_gpt2.config.n_head
    # By hand: mean squared query per channel (c_attn's output holds the queries first) times the squared key range.
    power = []
    hook = tiny_gpt2.transformer.h[0].attn.c_attn.register_forward_hook(
        lambda module, args, out: power.append(out[0, config.sinks:, :hidden].pow(2).mean(dim=0)))
    with torch.no_grad():
        for sample in random_ids:
            tiny_gpt2(sample[None])
    hook.remove()
    score = sum(power).reshape(heads, -1) * (spec.key_ranges.hi[0] - spec.key_ranges.lo[0]).pow(2)
    assert config.key_channels == 2
    assert torch.equal(spec.key_ranges.kept[0], score.topk(2, dim=-1).indices.sort(dim=-1).values)
    out = tiny_gpt2(random_ids[:1], past_key_values=spec.new_cache(tiny_gpt2), use_cache=True).logits
    assert torch.isfinite(out).all()


def test_bit_width_defaults_apply_only_where_options_are_left_unset() -> None:
    assert (KVQuantConfig(3, 3).key_block, KVQuantConfig(3, 3).outliers, KVQuantConfig(3, 3).key_channels) == \
        (16, 0.047, 2)
    assert (KVQuantConfig(4, 4).key_block, KVQuantConfig(4, 4).outliers, KVQuantConfig(4, 4).key_channels) == \
        (32, 0.01, 0)
    assert KVQuantConfig(3, 4).outliers == 0.01 and KVQuantConfig(4, 3).outliers == 0.047  # outliers: value bits
    plain = KVQuantConfig(3, 3, key_block=32, outliers=0.01, key_channels=0)
    assert plain.name == "k3v3-o0.01-s8-b32"
    assert KVQuantConfig.from_dict(KVQuantConfig(3, 3).to_dict()) == KVQuantConfig(3, 3)


@pytest.mark.parametrize("options,match", [
    ({"key_bits": 5}, "unsupported KV-cache key bit width 5"),
    ({"value_bits": 16}, "value bit width 16"),
    ({"outliers": 0.7}, "outlier share"),
    ({"sinks": -1}, "sinks"),
    ({"key_axis": "head"}, "key axis"),
    ({"levels": "log"}, "levels"),
    ({"momentum": 1.0}, "momentum"),
    ({"segment": 0}, "segment"),
    ({"key_channels": -2}, "key_channels"),
    ({"key_block": -1}, "key_block"),
    ({"key_block": 1.5}, "key_block"),
])
def test_bad_options_are_named(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVQuantConfig(**options)


def test_ranges_for_another_model_are_refused(calibrated, tiny_gpt2, random_ids) -> None:
    _, spec = calibrated
    with pytest.raises(ConfigError, match="calibrated for keys of shape"):
        tiny_gpt2(random_ids[:1], past_key_values=QuantizedKVCache.for_model(tiny_gpt2, spec.config,
                                                                              spec.key_ranges), use_cache=True)
    three = KeyRanges(*(r + r[:1] for r in (spec.key_ranges.lo, spec.key_ranges.hi, spec.key_ranges.kept)))
    with pytest.raises(ConfigError, match="cover 3 layers"):
        QuantizedKVCache.for_model(calibrated[0], spec.config, three)


def test_calibration_too_short_for_the_sinks(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="attention-sink"):
        lq.SimQuant(KVQuantConfig(sinks=4)).calibrate(tiny_llama, torch.ones(2, 4, dtype=torch.long))


def test_checkpoint_carries_the_cache(tiny_llama, random_ids, tmp_path: Path) -> None:
    model = lq.quantize(tiny_llama, [lq.RTN(), lq.SimQuant(KVQuantConfig(4, 4, key_channels=1))], lq.W8A16,
                        calib=random_ids, progress=False)
    spec = model.llmeasyquant.kv_cache
    assert spec is not None and spec.key_ranges is not None
    folder = lq.save(model, tmp_path / "ckpt")
    loaded, _ = lq.load(folder)
    back = loaded.llmeasyquant.kv_cache
    assert back.config == spec.config
    for mine, theirs in zip(spec.key_ranges.to_tensors().values(), back.key_ranges.to_tensors().values(),
                            strict=True):
        assert torch.equal(mine, theirs)
    ids = random_ids[:1]
    a = model(ids, past_key_values=spec.new_cache(model), use_cache=True).logits
    b = loaded(ids, past_key_values=back.new_cache(loaded), use_cache=True).logits
    assert torch.equal(a, b)
    (folder / "kv_cache.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no kv_cache\.safetensors"):
        lq.load(folder)
    (folder / "kv_cache.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"kv_cache\.safetensors is corrupt"):
        lq.load(folder)


def test_online_cache_needs_no_calibration(tiny_llama, random_ids) -> None:
    model = lq.quantize(tiny_llama, [lq.RTN(), lq.SimQuant(KVQuantConfig(8, 8))], lq.W8A16, progress=False)
    spec = model.llmeasyquant.kv_cache
    assert spec.key_ranges is None
    out = model(random_ids[:1], past_key_values=spec.new_cache(model), use_cache=True).logits
    assert (out - model(random_ids[:1]).logits).abs().max() < 0.05


@pytest.mark.parametrize(("family", "message"), [("gpt_neox", "turns 4 of the 16 channels of each head"),
                                                 ("gemma3_text", "no one rotary table for every layer")])
def test_keys_before_rope_need_one_whole_head_rotary_table(family: str, message: str) -> None:
    """GPT-NeoX rotates a quarter of each head, Gemma 3 rotates local and global layers differently: a cache
    that quantizes keys before RoPE is refused for them, and keys after RoPE still work."""
    model = tiny(family)
    with pytest.raises(ConfigError, match=message):
        QuantizedKVCache.for_model(model, KVQuantConfig())
    with pytest.raises(ConfigError, match=message):
        lq.SimQuant(KVQuantConfig()).calibrate(model, torch.randint(0, 256, (2, 24)), progress=False)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        cache = QuantizedKVCache.for_model(model, KVQuantConfig(key_bits=8, value_bits=8, pre_rope=False))
        found = model(ids, past_key_values=cache).logits
    assert (found - reference).abs().max() < 0.05 * reference.abs().max()
