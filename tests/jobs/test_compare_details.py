"""What `compare --details` measures for the report: speed and its latency breakdown, block errors, weight
histograms and summaries, context-length scaling; and compare over several methods, from the API and the CLI."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tests.cli_helpers import assert_one_line_error, run

import llmeasyquant as lq
from llmeasyquant.eval.layer_stats import (
    SUMMARY_FEATURES,
    block_output_errors,
    context_perplexities,
    representative_layer,
    weight_histogram,
    weight_summaries,
)
from llmeasyquant.eval.speed import generation_speed, latency_breakdown
from llmeasyquant.record import read_records


def _w8a8(model: torch.nn.Module) -> torch.nn.Module:
    return lq.quantize(model, lq.RTN(), lq.W8A8, progress=False)


def test_generation_speed_and_latency_breakdown(make_model, random_ids) -> None:
    base = make_model("llama")
    prompt = random_ids[:1]
    speed = generation_speed(base, prompt, new_tokens=4)
    assert speed["prefill_tok_s"] > 0 and speed["decode_tok_s"] > 0 and speed["prompt_tokens"] == 32
    assert generation_speed(base, prompt, new_tokens=4, runtime="auto")["runtime"] == "lean"  # llama has the loop
    assert generation_speed(make_model("gpt2"), prompt, new_tokens=4, runtime="auto")["runtime"] == "transformers"
    with pytest.raises(ValueError, match="at least 2"):
        generation_speed(base, prompt, new_tokens=1)
    float_parts = latency_breakdown(base, prompt, new_tokens=4)
    assert set(float_parts) == {"load", "quant", "gemm", "other"}
    assert float_parts["quant"] == 0 and float_parts["load"] == 0 and float_parts["gemm"] > 0
    parts = latency_breakdown(_w8a8(make_model("llama")), prompt, new_tokens=4)
    assert parts["quant"] > 0 and parts["gemm"] > 0 and all(v >= 0 for v in parts.values())


def test_block_errors_histogram_and_summaries(make_model, random_ids) -> None:
    base = make_model("llama")
    window = random_ids[0]
    quantized = lq.quantize(make_model("llama"), lq.RTN(), lq.parse_scheme("w4a16-g32"), progress=False)
    same = block_output_errors(base, make_model("llama"), window)
    assert list(same) == ["model.layers.0", "model.layers.1"] and all(v == 0 for v in same.values())
    errors = block_output_errors(base, quantized, window)
    assert all(0 < v < 1 for v in errors.values())
    name = representative_layer(quantized)
    hist = weight_histogram(base, quantized, name, bins=20)
    assert hist["layer"] == name and len(hist["edges"]) == 21
    weights = quantized.get_submodule(name).in_features * quantized.get_submodule(name).out_features
    assert sum(hist["float"]) == weights and sum(hist["quantized"]) == weights
    assert sum(c > 0 for c in hist["quantized"]) <= 16 * 2  # 4-bit codes: few distinct values per group scale
    summaries = weight_summaries(quantized, errors)
    assert len(summaries) == 14 and all(len(v) == len(SUMMARY_FEATURES) for v in summaries.values())
    assert all(math.isfinite(x) for v in summaries.values() for x in v)


def test_context_perplexities_skip_lengths_the_text_cannot_fill(make_model) -> None:
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0))
    ppl = context_perplexities(make_model("llama"), ids, (16, 32, 128), windows=2)
    assert set(ppl) == {"16", "32"} and all(v > 1 for v in ppl.values())


def test_compare_methods_with_details(llama_folder: Path, wiki_text: Path, calib_text: Path) -> None:
    spec = lq.CompareSpec(str(llama_folder), text=str(wiki_text), seqlen=32, max_windows=3, calib=str(calib_text),
                          calib_samples=4, calib_seqlen=32, methods=["rtn", "gptq"], details=True,
                          method_options={"act_order": False})
    records = lq.compare(spec, progress=False)
    assert [r.metric("method") for r in records] == ["fp32", "rtn", "gptq"]
    assert [r.metric("scheme") for r in records] == ["fp32", "w8a16", "w4a16-g128"]
    gptq = records[2].metrics
    assert gptq["calib_samples"] == 4 and records[1].metric("calib_samples") == 0
    assert records[2].protocol["recipe"][0]["act_order"] is False
    for record in records:
        m = record.metrics
        assert m["decode_tok_s"] > 0 and set(m["latency"]) == {"load", "quant", "gemm", "other"}
        assert set(m["context_ppl"]) <= {"128", "256", "512", "1024"}
    assert "layer_errors" not in records[0].metrics and len(gptq["layer_errors"]) == 2
    assert records[2].protocol["speed"]["new_tokens"] == 64


def test_cli_compare_methods_writes_the_report(capsys, llama_folder: Path, wiki_text: Path, calib_text: Path,
                                               tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = tmp_path / "report.html"
    code, out, err = run(capsys, "compare", llama_folder, "--methods", "rtn,smoothquant", "--calib", calib_text,
                         "--calib-samples", "4", "--calib-seqlen", "32", "--text", wiki_text, "--seqlen", "32",
                         "--max-windows", "2", "--report", report, "--json", tmp_path / "rows.json")
    assert code == 0, err
    assert "methods rtn, smoothquant" in out and re.search(r"^method\s+scheme", out, re.M)
    html = report.read_text()
    # Self-contained: no link out (the base64 payloads are left out of that check: any four letters occur in them).
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html).replace("http-equiv", "")
    assert html.count("data:image/png;base64,") == 8 and "http" not in text
    rows = read_records(tmp_path / "rows.json")
    assert [r.metric("method") for r in rows] == ["fp32", "rtn", "smoothquant+rtn"]
    code, _, err = run(capsys, "compare", llama_folder, "--methods", "rtn", "--text", wiki_text, "--seqlen", "32",
                       "--max-windows", "1", "--report", report)
    assert_one_line_error(code, err, "exists already", "--force")
    code, _, err = run(capsys, "compare", llama_folder, "--methods", "rtn,gptq", "--text", wiki_text)
    assert_one_line_error(code, err, "gptq need calibration text")
    code, _, err = run(capsys, "compare", llama_folder, "--methods", "rtn", "--schemes", "w8a8,w8a16")
    assert_one_line_error(code, err, "at most one scheme")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_one_block_estimate_leaves_the_model_whole(make_model, random_ids, kind: str) -> None:
    from llmeasyquant.jobs.estimate import first_blocks_copy, quantize_seconds

    model = make_model(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small = first_blocks_copy(model)
    assert len(small.get_submodule(lq.models.arch.arch_for(small).blocks)) == 1
    assert small(random_ids[:1], use_cache=False).logits.shape[-1] == model.config.vocab_size
    seconds = quantize_seconds(model, lq.methods.recipe_by_name("gptq"), lq.parse_scheme("w4a16-g32"), random_ids)
    assert seconds > 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, lq.QuantLinear) for m in model.modules())


def test_compare_logs_its_estimate_before_it_starts(llama_folder: Path, wiki_text: Path, calib_text: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="llmeasyquant.jobs.estimate"):
        records = lq.compare(lq.CompareSpec(str(llama_folder), text=str(wiki_text), seqlen=32, max_windows=2,
                                            calib=str(calib_text), calib_samples=4, calib_seqlen=32,
                                            methods=["rtn", "gptq"]), progress=True)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert re.search(r"estimated time: about \d+ min \(quantization rtn w8a16 \d+ s, gptq w4a16-g128 \d+ s", said)
    # The records keep the estimate beside what it estimated, so its accuracy can be checked afterwards.
    assert all(r.protocol["estimated_s"] > 0 and r.protocol["wall_s"] > 0 for r in records)
    assert all(r.metric("quantize_estimate_s") > 0 for r in records[1:])
