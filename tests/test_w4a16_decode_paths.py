"""benchmarks/w4a16_decode_paths.py on a small shape: both paths timed, the row's figures consistent."""

from __future__ import annotations

import time

import pytest
from tests.benchmark_helpers import load_benchmark

from llmeasyquant.kernels import native


@pytest.fixture(scope="module")
def paths():
    return load_benchmark("w4a16_decode_paths")


@pytest.mark.skipif(native.ops() is None, reason="the native operators are not built here")
def test_each_row_times_both_paths_on_the_layer_it_names(paths):
    rows = paths.measure([("toy", "up", 256, 12)], threads=[1], rows=[1, 4], rounds=2, per_round=2)
    assert [(r["layer"], r["rows"], r["threads"]) for r in rows] == [("up", 1, 1), ("up", 4, 1)]
    for row in rows:
        assert row["table_fp32_ms"] > 0 and row["bf16_dot_ms"] > 0
        assert row["speedup"] == pytest.approx(row["table_fp32_ms"] / row["bf16_dot_ms"])
        # codes (256 x 12 nibbles) and fp32 scales (12 x 2 groups of 128), read once a call
        assert row["bf16_dot_gbs"] == pytest.approx((256 * 12 // 2 + 12 * 2 * 4) / row["bf16_dot_ms"] / 1e6)


def test_best_round_takes_the_fastest_round(paths):
    calls = []
    durations = iter([0.0, 0.004, 0.001])  # the warm-up call, then two rounds of one call

    def slow_then_fast():
        calls.append(1)
        time.sleep(next(durations))

    best = paths.best_round_ms({"f": slow_then_fast}, rounds=2, per_round=1)
    assert len(calls) == 3
    assert 1.0 <= best["f"] < 4.0
