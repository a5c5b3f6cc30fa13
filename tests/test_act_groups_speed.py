"""benchmarks/act_groups_speed.py on a tiny checkpoint: both ways timed in each round, decode and prefill, the record;
the per-token copy really has one scale a token; a checkpoint without activation groups is refused."""

from __future__ import annotations

import pytest
from tests.benchmark_helpers import load_benchmark, run_ab_benchmark

import llmeasyquant as lq
from llmeasyquant.errors import ConfigError
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.scheme import PerGroup, PerToken


@pytest.fixture
def act_groups_speed():
    return load_benchmark("act_groups_speed")


def test_both_ways_are_timed_every_round(act_groups_speed, tiny_llama, tmp_path):
    checkpoint = tmp_path / "w4a4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a4-aasym-ag32-g32-asym"), progress=False), checkpoint)
    kind, metrics = run_ab_benchmark(act_groups_speed, checkpoint, tmp_path / "speed.json", ("groups", "token"))
    assert kind == "act_groups_speed"
    prefill = metrics["prefill"]
    assert len(prefill["rounds"]) == 2 and prefill["tok_s_groups"] > 0 and prefill["tok_s_token"] > 0
    model, _ = lq.load(checkpoint)
    assert {m.scheme.act.granularity for m in model.modules() if isinstance(m, QuantLinear)} == {PerGroup(32)}
    act_groups_speed.one_scale_a_token(model)
    assert {m.scheme.act.granularity for m in model.modules() if isinstance(m, QuantLinear)} == {PerToken()}


def test_a_checkpoint_without_activation_groups_is_refused(act_groups_speed, tiny_llama, tmp_path):
    checkpoint = tmp_path / "w4a4"
    lq.save(lq.quantize(tiny_llama, lq.RTN(), lq.parse_scheme("w4a4-g32"), progress=False), checkpoint)
    with pytest.raises(ConfigError, match="--act-group-size"):
        act_groups_speed.main([str(checkpoint), "--rounds", "1", "--out", str(tmp_path / "speed.json")])
