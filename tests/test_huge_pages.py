"""benchmarks/huge_pages.py on a tiny checkpoint: both copies timed in each round, the same tokens, the record."""

from __future__ import annotations

import pytest
import torch
from tests.benchmark_helpers import load_benchmark

import llmeasyquant as lq
from llmeasyquant.infra.memory import huge_pages_available
from llmeasyquant.record import read_records


@pytest.fixture
def huge_pages():
    return load_benchmark("huge_pages")


def test_both_copies_are_timed_every_round_and_recorded(huge_pages, tiny_llama, tmp_path):
    threads = torch.get_num_threads()
    checkpoint = tmp_path / "w4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a16"), progress=False), checkpoint)
    out = tmp_path / "huge_pages.json"
    assert huge_pages.main([str(checkpoint), "--rounds", "2", "--threads", "1", "--prompt-tokens", "8",
                            "--new-tokens", "3", "--out", str(out)]) == 0
    [record] = read_records(out)
    metrics = record.metrics
    assert record.kind == "huge_pages" and record.model == "w4" and metrics["same_tokens"]
    assert [sorted(r["order"]) for r in metrics["rounds"]] == [["2m", "4k"], ["2m", "4k"]]
    assert all(r["4k"] > 0 and r["2m"] > 0 for r in metrics["rounds"])
    assert metrics["speedup"] == pytest.approx(metrics["tok_s_2m"] / metrics["tok_s_4k"])
    assert (metrics["bytes_moved"] > 0) == huge_pages_available()
    assert str(tmp_path) not in out.read_text()  # the command names the checkpoint, not this machine's path
    assert torch.get_num_threads() == threads  # --threads is the run's, not the process's afterwards
