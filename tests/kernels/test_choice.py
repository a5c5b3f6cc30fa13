"""The kernel measured fastest per shape and row count: candidates, buckets, the cache, forcing, bad settings."""

from __future__ import annotations

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.errors import ConfigError
from llmeasyquant.kernels import candidates, choice

INT8PACK, INT_MM, REFERENCE = "cpu_int8pack_w8a16", "cpu_int_mm_w8a8", "reference"


@pytest.fixture(autouse=True)
def _measured(monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "measured")
    # The choice logic with PyTorch's kernels as candidates; kernels/test_native_ops.py adds the fused-operator one.
    monkeypatch.setenv("LLMEASYQUANT_NATIVE", "0")
    monkeypatch.delenv("LLMEASYQUANT_KERNEL", raising=False)
    choice.forget_choices()
    yield
    choice.forget_choices()


def layer(scheme: str, in_features: int = 576, out_features: int = 192, seed: int = 0) -> lq.QuantLinear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    return lq.QuantLinear.from_weight(weight, None, lq.parse_scheme(scheme))


def test_candidates():
    assert [k.name for k in candidates(layer("w8a16"))] == [INT8PACK, REFERENCE]  # dequantize-GEMM as a rival
    assert [k.name for k in candidates(layer("w8a8"))] == [INT_MM]  # no float path for integer activations
    assert candidates(layer("w8a16", in_features=100)) == []  # no fast kernel: the reference alone, unmeasured


def test_choice_per_row_bucket_measured_once_per_shape(monkeypatch):
    calls = []

    def fake_timer(target, kernel, x):  # the int8 operator wins at few rows, the dequantize-GEMM at many
        calls.append((kernel.name, x.shape[0]))
        few = x.shape[0] <= 16
        return {INT8PACK: 1.0 if few else 3.0, REFERENCE: 2.0}[kernel.name]

    monkeypatch.setattr(choice, "_seconds", fake_timer)
    first = layer("w8a16")
    assert first.kernel(1).name == INT8PACK
    assert first.kernel(9).name == INT8PACK  # bucket 16
    assert first.kernel(512).name == REFERENCE
    assert first.kernel(3000).name == REFERENCE  # beyond the last bucket: the last bucket's choice
    assert sorted(calls) == sorted([(INT8PACK, 1), (REFERENCE, 1), (INT8PACK, 16), (REFERENCE, 16),
                                    (INT8PACK, 512), (REFERENCE, 512)])
    second = layer("w8a16", seed=1)  # same scheme and shape: the measurement is reused
    assert second.kernel(1).name == INT8PACK and second.kernel(512).name == REFERENCE
    assert len(calls) == 6
    other_shape = layer("w8a16", out_features=64)
    other_shape.kernel(1)
    assert len(calls) == 8
    x = torch.randn(512, 576)
    torch.testing.assert_close(first(x), x @ first.dequantize().t())  # the reference arithmetic exactly
    assert "kernel by rows=(1: cpu_int8pack_w8a16, 16: cpu_int8pack_w8a16, 512: reference)" in repr(first)


def test_choice_is_per_thread_count(monkeypatch):
    """A layer keeps its choice per thread count: one thread may favour another kernel than two."""
    monkeypatch.setattr(choice, "_seconds", lambda target, kernel, x: {
        INT8PACK: 1.0 if torch.get_num_threads() == 1 else 3.0, REFERENCE: 2.0}[kernel.name])
    target = layer("w8a16")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert target.kernel(1).name == INT8PACK
        torch.set_num_threads(2)
        assert target.kernel(1).name == REFERENCE
        assert target.chosen_kernels() == {1: REFERENCE}
    finally:
        torch.set_num_threads(before)


def test_real_measurement_picks_a_candidate_and_keeps_results():
    target = layer("w8a16")
    for rows in (1, 200):
        x = torch.randn(rows, 576)
        name = target.kernel(rows).name
        assert name in (INT8PACK, REFERENCE)
        reference = x @ target.dequantize().t()
        err = (target(x) - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
        assert err <= 1e-2  # bf16 rounding at most
    assert len(choice._CHOSEN) == 2


def test_forced_kernel_is_not_measured(monkeypatch):
    monkeypatch.setattr(choice, "_seconds", lambda *_: pytest.fail("a forced kernel must not be measured"))
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", INT8PACK)
    assert layer("w8a16").kernel(512).name == INT8PACK


def test_fixed_order_and_bad_setting(monkeypatch):
    monkeypatch.setattr(choice, "_seconds", lambda *_: pytest.fail("the fixed order measures nothing"))
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "first")
    assert layer("w8a16").kernel(512).name == INT8PACK
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "fastest")
    with pytest.raises(ConfigError, match="LLMEASYQUANT_KERNEL_CHOICE='fastest'"):
        layer("w8a16").kernel(1)


def test_pinned_choice_is_fixed_and_kept_apart(monkeypatch):
    """Calibration pins kernels: nothing is measured, a weight-only layer runs the reference (the oracle), a layer
    with integer activations the first kernel; outside, the layer's measured choice is untouched."""
    monkeypatch.setattr(choice, "_seconds", lambda target, kernel, x: {INT8PACK: 1.0, REFERENCE: 2.0}[kernel.name])
    weight_only, integer = layer("w8a16"), layer("w8a8")
    assert weight_only.kernel(512).name == INT8PACK  # measured: the (fake) faster one
    monkeypatch.setattr(choice, "_seconds", lambda *_: pytest.fail("a pinned kernel must not be measured"))
    with choice.pinned():
        assert choice.is_pinned()
        assert weight_only.kernel(512).name == REFERENCE
        assert integer.kernel(512).name == INT_MM
        x = torch.randn(512, 576)
        assert torch.equal(weight_only(x), x @ weight_only.dequantize().t())
    assert not choice.is_pinned()
    assert weight_only.kernel(512).name == INT8PACK
    assert weight_only.chosen_kernels() == {512: INT8PACK}


def test_the_fastest_kernel_wins_at_every_row_count():
    # Every CPU kernel runs inside the engine's native step, so none is credited for a path of its own.
    class Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

    times = {"a": 1.0, "b": 1.01}
    target = layer("w8a16")

    def chosen(rows: int) -> str:
        choice.forget_choices()
        kernels = [Kernel("b"), Kernel("a")]
        return choice.choose(target, kernels, rows, lambda layer_, kernel, x: times[kernel.name]).name

    assert not hasattr(choice, "ONE_CALL_CREDIT")
    assert chosen(1) == chosen(16) == chosen(512) == "a"
    times["b"] = 0.99
    assert chosen(1) == "b"
