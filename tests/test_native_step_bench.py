"""benchmarks/native_step.py on a tiny checkpoint: both ways timed in each round, the same logits, the record."""

from __future__ import annotations

import pytest
from tests.benchmark_helpers import load_benchmark, run_ab_benchmark

import llmeasyquant as lq
from llmeasyquant.kernels import native


@pytest.fixture
def native_step_bench():
    return load_benchmark("native_step")


@pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")
def test_both_ways_are_timed_every_round_and_recorded(native_step_bench, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "cpu_native_w4a16_i16")  # the measured choice's, for every layer
    checkpoint = tmp_path / "w4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a16-g32"), progress=False), checkpoint)
    kind, metrics = run_ab_benchmark(native_step_bench, checkpoint, tmp_path / "native_step.json", ("native", "python"))
    assert kind == "native_step" and metrics["same_logits"]
    assert metrics["native_blocks"] == metrics["blocks"] == tiny_llama.config.num_hidden_layers
