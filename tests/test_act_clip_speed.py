"""benchmarks/act_clip_speed.py on a tiny checkpoint: both ways timed in each round, decode and prefill, the record;
a checkpoint that does not search its clip is refused."""

from __future__ import annotations

import pytest
from tests.benchmark_helpers import load_benchmark, run_ab_benchmark

import llmeasyquant as lq
from llmeasyquant.errors import ConfigError
from llmeasyquant.nn.qlinear import QuantLinear


@pytest.fixture
def act_clip_speed():
    return load_benchmark("act_clip_speed")


def test_both_ways_are_timed_every_round_and_the_layers_left_searching(act_clip_speed, tiny_llama, tmp_path):
    checkpoint = tmp_path / "w4a4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a4-aasym-acs-g32-asym"), progress=False), checkpoint)
    kind, metrics = run_ab_benchmark(act_clip_speed, checkpoint, tmp_path / "speed.json", ("search", "fixed"))
    assert kind == "act_clip_speed" and metrics["fraction"] == 0.9
    prefill = metrics["prefill"]
    assert len(prefill["rounds"]) == 2 and prefill["tok_s_search"] > 0 and prefill["tok_s_fixed"] > 0
    model, _ = lq.load(checkpoint)
    act_clip_speed.set_clipping(model, False, 0.8)
    assert {m.scheme.act.clip for m in model.modules() if isinstance(m, QuantLinear)} == {0.8}


def test_a_checkpoint_that_does_not_search_is_refused(act_clip_speed, tiny_llama, tmp_path):
    checkpoint = tmp_path / "w4a4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a4-ac90-g32"), progress=False), checkpoint)
    with pytest.raises(ConfigError, match="--act-clip search"):
        act_clip_speed.main([str(checkpoint), "--rounds", "1", "--out", str(tmp_path / "speed.json")])
