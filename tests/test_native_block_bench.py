"""benchmarks/native_block.py on a tiny checkpoint: both ways timed in each round, the same logits, the record."""

from __future__ import annotations

import pytest
import torch
from tests.benchmark_helpers import load_benchmark

import llmeasyquant as lq
from llmeasyquant.kernels import native
from llmeasyquant.record import read_records


@pytest.fixture
def native_block():
    return load_benchmark("native_block")


@pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")
def test_both_ways_are_timed_every_round_and_recorded(native_block, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "cpu_native_w4a16_i16")  # the measured choice's, for every layer
    threads = torch.get_num_threads()
    checkpoint = tmp_path / "w4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a16-g32"), progress=False), checkpoint)
    out = tmp_path / "native_block.json"
    assert native_block.main([str(checkpoint), "--rounds", "2", "--threads", "1", "--prompt-tokens", "8",
                              "--new-tokens", "3", "--out", str(out)]) == 0
    [record] = read_records(out)
    metrics = record.metrics
    assert record.kind == "native_block" and record.model == "w4" and metrics["same_logits"]
    assert metrics["native_blocks"] == metrics["blocks"] == tiny_llama.config.num_hidden_layers
    assert [sorted(r["order"]) for r in metrics["rounds"]] == [["native", "python"]] * 2
    assert all(r["native"] > 0 and r["python"] > 0 for r in metrics["rounds"])
    assert metrics["speedup"] == pytest.approx(metrics["tok_s_native"] / metrics["tok_s_python"])
    assert str(tmp_path) not in out.read_text()
    assert torch.get_num_threads() == threads
