"""benchmarks/engine_overhead.py on the tiny llama: each batch's decode steps split into the native blocks, the head
and the rest, over the rounds, in a record that names no path of this machine."""

from __future__ import annotations

import pytest
import torch
from tests.benchmark_helpers import load_benchmark

from llmeasyquant.kernels import native
from llmeasyquant.record import read_records


@pytest.mark.skipif(native.ops() is None, reason="needs the fused C++ operators")
def test_each_batch_is_split_into_native_head_and_rest(llama_folder, tmp_path):
    bench = load_benchmark("engine_overhead")
    threads = torch.get_num_threads()
    out = tmp_path / "overhead.json"
    assert bench.main([str(llama_folder), "--batches", "1,3", "--rounds", "2", "--threads", "1",
                       "--prompt-tokens", "8", "--new-tokens", "6", "--out", str(out)]) == 0
    torch.set_num_threads(threads)
    records = read_records(out)
    assert [r.metrics["batch"] for r in records] == [1, 3]
    for record in records:
        metrics = record.metrics
        assert len(metrics["rounds"]) == 2 and all(r["steps"] >= 1 for r in metrics["rounds"])
        assert metrics["native_ms"] > 0 and metrics["head_ms"] > 0  # the whole tiny llama steps natively
        assert metrics["step_ms"] >= metrics["native_ms"] + metrics["head_ms"]
        assert 0 < metrics["outside_native_share"] < 1
        assert str(tmp_path) not in record.command and record.model == llama_folder.name
