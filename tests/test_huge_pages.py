"""benchmarks/huge_pages.py on a tiny checkpoint: both copies timed in each round, the same tokens, the record."""

from __future__ import annotations

import pytest
from tests.benchmark_helpers import load_benchmark, run_ab_benchmark

import llmeasyquant as lq
from llmeasyquant.infra.memory import huge_pages_available


@pytest.fixture
def huge_pages():
    return load_benchmark("huge_pages")


def test_both_copies_are_timed_every_round_and_recorded(huge_pages, tiny_llama, tmp_path):
    checkpoint = tmp_path / "w4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a16"), progress=False), checkpoint)
    kind, metrics = run_ab_benchmark(huge_pages, checkpoint, tmp_path / "huge_pages.json", ("2m", "4k"))
    assert kind == "huge_pages" and metrics["same_tokens"]
    assert (metrics["bytes_moved"] > 0) == huge_pages_available()
