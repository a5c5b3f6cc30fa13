"""benchmarks/scale_speed.py: bytes per token, the bound and the record, on the tiny synthetic shape.

The end-to-end run quantizes in child processes and reads the bundled SmolLM2 tokenizer, hence the slow marker.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tests.benchmark_helpers import load_benchmark

import llmeasyquant as lq
from llmeasyquant.nn.qlinear import QuantLinear

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def speed() -> ModuleType:
    return load_benchmark("scale_speed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    synthetic = load_benchmark("make_synthetic")
    return synthetic.generate("llama-tiny", tmp_path_factory.mktemp("synthetic") / "llama-tiny", seed=0)


def test_bound_is_bandwidth_over_bytes(speed):
    assert speed.bound(20.0, 4 * 10**9) == pytest.approx(5.0)
    assert speed.bound(10.0, 10**9) == pytest.approx(2 * speed.bound(10.0, 2 * 10**9))


def test_stored_bytes_count_codes_scales_head_and_norms_but_not_the_embedding(speed, tiny):
    model, _ = lq.load_model(str(tiny))
    plan = lq.Plan((lq.Rule("lm_head", lq.parse_scheme("w4a16-g32")), *lq.Plan.uniform(
        lq.parse_scheme("w4a16-g32")).rules))
    model = lq.quantize(model, lq.RTN(), plan, progress=False).eval()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert any(name == "lm_head" for name, m in model.named_modules() if isinstance(m, QuantLinear))
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    biases = sum(m.bias.numel() * m.bias.element_size() for m in layers if m.bias is not None)
    rotary = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    expected = sum(m.storage_bytes() for m in layers) + biases + norms + rotary
    stored = speed.weight_bytes_per_token(model)
    assert stored == expected
    assert stored < sum(p.numel() * p.element_size() for p in model.parameters())  # the fp32 table is left out
    # Fused layers' buffers become views into one tensor: counted before fusing, and the kernels' view agrees.
    lq.fuse_shared_inputs(model)
    speed.decode_speed(model, torch.arange(8)[None], 3)
    kernels = speed.decode_kernels(model)
    assert sum(kernels.values()) == len(speed._running_layers(model)) == 2 * 4 + 1  # qkv, o, gate+up, down; head
    assert speed.kernel_bytes_per_token(model) >= sum(m.qweight.numel() for m in layers)  # at least every code byte


def test_kernel_bytes_need_a_decode_first(speed, tiny):
    model = lq.quantize(lq.load_model(str(tiny))[0], lq.RTN(), lq.Plan.uniform(lq.parse_scheme("w8a16")),
                        progress=False)
    with pytest.raises(ValueError, match="run a decode step"):
        speed.kernel_bytes_per_token(model)


def test_summary_takes_medians_and_compares_with_the_peers(speed):
    rounds = [{"bandwidth_gbs": bw, "ours_tok_s": ours, "llama_cpp": {"Q4_0": {"tok_s": peer}}}
              for bw, ours, peer in ((10.0, 3.0, 2.0), (12.0, 5.0, 4.0), (11.0, 4.0, 3.0))]
    row = speed.summarize("w4a16-g128", rounds, stored=2 * 10**9, kernel=3 * 10**9, peers={"Q4_0": 10**9})
    assert row["bandwidth_gbs"] == 11.0 and row["ours_tok_s"] == 4.0
    assert row["bound_tok_s"] == pytest.approx(5.5) and row["fraction_of_bound"] == pytest.approx(4.0 / 5.5)
    peer = row["llama_cpp"]["Q4_0"]
    assert peer["tok_s"] == 3.0 and peer["bound_tok_s"] == pytest.approx(11.0)
    assert peer["ours_over_llama_cpp"] == pytest.approx(4.0 / 3.0)
    failed = [r | {"llama_cpp": {"Q4_0": {"error": "exit 1: no such file"}}} for r in rounds]
    peer = speed.summarize("w4a16-g128", failed, 2 * 10**9, 3 * 10**9, {"Q4_0": 10**9})["llama_cpp"]["Q4_0"]
    assert peer["tok_s"] is None and peer["error"] == "exit 1: no such file" and "ours_over_llama_cpp" not in peer


def test_without_llama_bench_the_peers_are_skipped_with_a_reason(speed, tmp_path):
    assert speed.find_llama_bench(None) == (None, "no --llama-bench given: llama.cpp rows skipped")
    binary, why = speed.find_llama_bench(tmp_path / "llama-bench")
    assert binary is None and "is not an executable file" in why


def test_end_to_end_on_the_tiny_shape_without_llama_cpp(speed, tiny, tmp_path, capsys):
    out = tmp_path / "scale_speed.json"
    code = speed.main([str(tiny), "--work", str(tmp_path / "work"), "--schemes", "w8a8,w4a16-g128", "--repeats", "2",
                       "--prompt-tokens", "8", "--new-tokens", "3", "--timeout", "600", "--out", str(out)])
    assert code == 0
    assert "llama.cpp rows skipped" in capsys.readouterr().out
    records = json.loads(out.read_text())
    rows = {record["protocol"]["scheme"]: record["metrics"] for record in records}
    assert list(rows) == ["w8a8", "w4a16-g128"]
    for row in rows.values():
        assert len(row["rounds"]) == 2 and row["llama_cpp"] == {}
        assert row["ours_tok_s"] > 0 and row["bound_tok_s"] == pytest.approx(
            row["bandwidth_gbs"] * 1e9 / row["stored_bytes_per_token"])
        assert all(len(r["ours_conditions"]["loadavg"]) == 3 for r in row["rounds"])
    assert rows["w4a16-g128"]["stored_bytes_per_token"] < rows["w8a8"]["stored_bytes_per_token"]
    assert records[0]["protocol"]["llama_cpp_skipped"].startswith("no --llama-bench")
    assert records[1]["protocol"]["head"] == "w4a16-g128"
    quantized = records[0]["protocol"]["quantize"]["command"]
    assert quantized.startswith("llmeasyquant --quiet quantize llama-tiny --method rtn")
    assert str(tmp_path) not in json.dumps(records)  # no path of this machine in the records
    assert not list((tmp_path / "work").glob("*-w8a8"))  # checkpoints deleted without --keep
