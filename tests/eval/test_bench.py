"""bench: speeds against the float model from the same run, bytes read per token, the breakdown, the CLI."""

from __future__ import annotations

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.cli import main
from llmeasyquant.eval import bench as bench_module
from llmeasyquant.eval.bench import (
    BenchConfig,
    bench,
    memory_bandwidth_gbs,
    model_bytes,
    thread_counts,
    weight_bytes_per_token,
)
from llmeasyquant.infra.memory import huge_pages_available
from llmeasyquant.kernels import native
from llmeasyquant.record import read_records

SMALL = BenchConfig(prompt_tokens=12, new_tokens=3, prefill_tokens=24, repeats=2, threads=(1,))


@pytest.mark.parametrize("size", [64, 64 * 4096 + 64 * 7 + 5, 2**21])  # lines split over threads and streams
def test_streaming_read_xors_every_whole_line(size):
    ops = native.ops()
    if ops is None:
        pytest.skip("the fused operators do not build here")
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    words = data[: size // 64 * 64].view(torch.int64)
    expected = 0
    for word in words.tolist():  # the partial last line is not read
        expected ^= word
    assert ops.stream_xor(data) == expected


def test_bandwidth_is_the_faster_of_its_reads(monkeypatch):
    class SlowStream:  # a streaming read that takes 50 ms: the sum, far faster, must set the figure
        def stream_xor(self, buffer):
            import time

            time.sleep(0.05)
            return 0

    monkeypatch.setattr(bench_module.native, "ops", lambda: SlowStream())
    assert memory_bandwidth_gbs(megabytes=8, repeats=2) > 8 * 2**20 / 0.05 / 1e9
    monkeypatch.setattr(bench_module.native, "ops", lambda: None)  # no operators: the sum alone
    assert memory_bandwidth_gbs(megabytes=8, repeats=2) > 0


def test_weight_bytes_count_what_a_decode_step_reads(tiny_llama):
    float_bytes = weight_bytes_per_token(tiny_llama)
    params = sum(t.numel() * t.element_size() for t in [*tiny_llama.parameters(), *tiny_llama.buffers()])
    embed = tiny_llama.model.embed_tokens.weight
    tied = tiny_llama.lm_head.weight is embed
    # A tied table is read whole by the head; an untied one is only looked up (one row), so not counted.
    assert float_bytes == params - (0 if tied else embed.numel() * 4)
    model = lq.quantize(tiny_llama, lq.RTN(), lq.W8A16, progress=False)
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    assert weight_bytes_per_token(model) < float_bytes
    assert weight_bytes_per_token(model) >= sum(m.storage_bytes() for m in layers)
    assert model_bytes(model) >= weight_bytes_per_token(model)
    unfused = weight_bytes_per_token(model)
    assert lq.fuse_shared_inputs(model) > 0  # q/k/v and gate/up become row views into one tensor each
    assert weight_bytes_per_token(model) == unfused


def test_bench_rows_and_speedups(tiny_llama):
    quantized = lq.quantize(tiny_llama, lq.RTN(), lq.W8A16, progress=False)
    from conftest import build_model

    float_model = build_model("llama").eval()
    prompt = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    rows = bench({"float": float_model, "w8a16": quantized}, prompt, SMALL, baseline="float", progress=False)
    assert [(r["model"], r["threads"]) for r in rows] == [("float", 1), ("w8a16", 1)]
    for row in rows:
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["prefill_long_tok_s"] > 0
        assert len(row["decode_tok_s_runs"]) == 2
        assert row["bandwidth_bound_tok_s"] == pytest.approx(row["bandwidth_gbs"] * 1e9 / row["weight_bytes_per_token"])
        assert set(row["latency"]) == {"load", "quant", "gemm", "other"}
    layers = rows[1]["latency_layers_ms_per_token"]
    assert set(layers) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(v >= 0 for parts in layers.values() for v in parts.values())
    assert all(parts["gemm"] > 0 for parts in layers.values())  # every layer's GEMM is seen inside its scope
    in_layers = sum(sum(parts.values()) for parts in layers.values())
    assert in_layers <= sum(rows[1]["latency_ms_per_token"].values()) * 1.001
    assert rows[0]["latency_layers_ms_per_token"] == {}  # the float model has no quantized layers
    assert rows[0]["decode_speedup"] == 1.0
    assert rows[1]["slower_than_baseline"] == [key for key in bench_module.SPEEDUPS if rows[1][key] < 1.0]
    assert rows[1]["decode_speedup"] == pytest.approx(rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"])
    with pytest.raises(ValueError, match="bench needs 24"):
        bench({"float": float_model}, prompt[:, :10], SMALL, progress=False)
    with pytest.raises(ValueError, match="baseline"):
        bench({"float": float_model}, prompt, SMALL, baseline="other", progress=False)


def test_config_and_thread_count_errors():
    with pytest.raises(ValueError, match="new_tokens"):
        BenchConfig(new_tokens=1)
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(repeats=0)
    with pytest.raises(ValueError, match="thread counts"):
        BenchConfig(threads=(0,))
    assert thread_counts("1, 2") == (1, 2) and thread_counts(None) == ()
    with pytest.raises(ValueError, match="integers"):
        thread_counts("one")


def test_cli_bench_checkpoint_against_its_source(llama_folder, tmp_path, capsys):
    out = tmp_path / "w8"
    assert main(["--quiet", "quantize", str(llama_folder), "--lm-head", "w8a16", "--out", str(out)]) == 0
    capsys.readouterr()
    result = tmp_path / "bench.json"
    assert main(["--quiet", "bench", str(out), "--thread-counts", "1", "--repeats", "1", "--prompt-tokens", "8",
                 "--new-tokens", "3", "--prefill-tokens", "16", "--json", str(result)]) == 0
    printed = capsys.readouterr().out
    assert "decode tok/s" in printed and "(float)" in printed
    assert "q_proj+k_proj+v_proj" in printed and "lm_head" in printed  # the per-layer table, fused groups named
    records = read_records(result)
    assert [r.kind for r in records] == ["bench", "bench", "bench"]
    # The float model on transformers (the baseline) and on the lean loop, then the checkpoint on the lean loop.
    assert [r.metric("runtime") for r in records] == ["transformers", "lean", "lean"]
    assert records[0].model.endswith("(float)") and records[0].metric("decode_speedup") == 1.0
    assert records[1].model.endswith("(float, lean)")
    assert records[2].protocol["baseline"] == records[0].model
    assert records[2].metric("weight_bytes_per_token") < records[0].metric("weight_bytes_per_token")
    moved = records[2].protocol["huge_page_bytes"]  # every model's weights, where the system has huge pages
    assert set(moved) == {r.model for r in records}
    assert all(v > 0 for v in moved.values()) == huge_pages_available()
    assert main(["--quiet", "bench", str(out), "--runtime", "transformers", "--repeats", "1", "--prompt-tokens", "8",
                 "--new-tokens", "3", "--prefill-tokens", "16", "--no-breakdown", "--no-huge-pages",
                 "--json", str(result)]) == 0
    records = read_records(result)
    assert [r.metric("runtime") for r in records] == ["transformers", "transformers"]
    assert set(records[0].protocol["huge_page_bytes"].values()) == {0}
    capsys.readouterr()
    assert main(["--quiet", "bench", str(out), "--baseline", "none", "--repeats", "1", "--prompt-tokens", "8",
                 "--new-tokens", "3", "--prefill-tokens", "16", "--no-breakdown"]) == 0
    assert "(float)" not in capsys.readouterr().out
    plot = tmp_path / "latency.png"
    assert main(["--quiet", "bench", str(out), "--repeats", "1", "--prompt-tokens", "8", "--new-tokens", "3",
                 "--prefill-tokens", "16", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--quiet", "bench", str(out), "--plot", str(plot)]) == 2  # exists: needs --force
    assert "--force" in capsys.readouterr().err
    assert main(["--quiet", "bench", str(out), "--no-breakdown", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--no-breakdown" in capsys.readouterr().err
    assert main(["--quiet", "bench", str(tmp_path / "missing")]) == 2


def test_auto_runtime_falls_back_where_there_is_no_lean_loop(tiny_gpt2, tiny_llama):
    """The default runs GPT-2 (no lean-loop map in the arch table) on transformers' loop, llama on the lean one;
    asking for the lean loop on GPT-2 is an error that names the way out."""
    from llmeasyquant.errors import ConfigError

    gpt2 = lq.quantize(tiny_gpt2, lq.RTN(), lq.W8A16, progress=False)
    llama = lq.quantize(tiny_llama, lq.RTN(), lq.W8A16, progress=False)
    prompt = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    config = BenchConfig(prompt_tokens=12, new_tokens=3, prefill_tokens=24, repeats=1, threads=(1,), breakdown=False)
    rows = bench({"gpt2": gpt2, "llama": llama}, prompt, config, progress=False)
    assert [(r["model"], r["runtime"]) for r in rows] == [("gpt2", "transformers"), ("llama", "lean")]
    lean = BenchConfig(prompt_tokens=12, new_tokens=3, prefill_tokens=24, repeats=1, threads=(1,), runtime="lean")
    with pytest.raises(ConfigError, match="--runtime transformers"):
        bench({"gpt2": gpt2}, prompt, lean, progress=False)
    with pytest.raises(ValueError, match="unknown runtime"):
        BenchConfig(runtime="fast")



def test_a_model_slower_than_its_baseline_is_flagged():
    base = {"model": "float", "threads": 2, "prefill_tok_s": 100.0, "prefill_long_tok_s": 100.0,
            "decode_tok_s": 10.0, "weight_bytes_per_token": 4e8, "bandwidth_bound_tok_s": 50.0}
    slow = {**base, "model": "w4a16", "prefill_speedup": 0.91, "prefill_long_speedup": 1.2, "decode_speedup": 8.6,
            "slower_than_baseline": ["prefill_speedup"]}
    fast = {**base, "model": "w8a8", "prefill_speedup": 2.8, "prefill_long_speedup": 2.0, "decode_speedup": 8.8,
            "slower_than_baseline": []}
    flagged = [line for line in bench_module.summary_lines([base, slow, fast]) if line.startswith("SLOWER")]
    assert len(flagged) == 1 and "w4a16 (prefill 0.91x)" in flagged[0]
