"""The CLI in-process: quantize, eval and compare on a tiny model folder, and every error as one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

import llmeasyquant as lq
from cli_helpers import assert_one_line_error, run
from llmeasyquant.cli import main
from llmeasyquant.export.checkpoint import QCONFIG_FILE, WEIGHTS_FILE, checkpoint_bytes
from llmeasyquant.nn.qlinear import quantized_layers
from llmeasyquant.nn.transform import input_transform_of
from llmeasyquant.record import read_records

EVAL_ARGS = ["--seqlen", "32", "--max-windows", "3"]


@pytest.fixture(scope="module")
def checkpoint(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-bit checkpoint of the tiny llama folder, written by the CLI once for the module."""
    out = tmp_path_factory.mktemp("cli") / "w8"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rtn", "--bits", "8", "--out", str(out)]) == 0
    return out


# quantize ----------------------------------------------------------------------------------------------------


def test_quantize_writes_checkpoint_and_record(capsys, llama_folder: Path, tmp_path: Path) -> None:
    out, record_path = tmp_path / "out", tmp_path / "q.json"
    code, stdout, _ = run(capsys, "quantize", llama_folder, "--method", "rtn", "--bits", "8", "--out", out,
                          "--json", record_path)
    assert code == 0
    assert stdout.startswith(f"saved {out} (rtn, w8a16):")
    assert "bits per quantized weight" in stdout
    assert {WEIGHTS_FILE, "config.json", QCONFIG_FILE, "tokenizer.json"} <= {p.name for p in out.iterdir()}
    [rec] = read_records(record_path)
    assert rec.kind == "quantize"
    assert rec.model == str(llama_folder)
    m = rec.metrics
    assert 8 < m["bits_per_weight"] < 8.5
    assert m["checkpoint_bytes"] == checkpoint_bytes(out)
    assert m["quantize_s"] >= 0
    assert rec.protocol["method"] == "rtn"
    assert rec.protocol["plan"]["rules"][0]["scheme"]["bits"] == 8
    qconfig = json.loads((out / QCONFIG_FILE).read_text())
    assert qconfig["source_model"] == str(llama_folder.resolve())
    assert {s["granularity"] for s in qconfig["layers"].values()} == {"channel"}
    model, tokenizer = lq.load(out)
    assert tokenizer is not None
    assert sum(isinstance(m, lq.QuantLinear) for m in model.modules()) == 14


def test_quantize_refuses_to_overwrite_without_force(capsys, llama_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run(capsys, "quantize", llama_folder, "--bits", "8", "--out", out)[0] == 0
    before = (out / WEIGHTS_FILE).read_bytes()
    code, _, err = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--out", out)
    assert_one_line_error(code, err, "--force", str(out))
    assert (out / WEIGHTS_FILE).read_bytes() == before
    code, _, _ = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--out", out, "--force")
    assert code == 0
    assert json.loads((out / QCONFIG_FILE).read_text())["layers"]["model.layers.0.mlp.up_proj"]["bits"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old folders left


def test_quantize_four_bit_groups_asymmetric(capsys, llama_folder: Path, tmp_path: Path) -> None:
    out, record_path = tmp_path / "w4", tmp_path / "q.json"
    code, _, _ = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--asym",
                     "--out", out, "--json", record_path)
    assert code == 0
    assert read_records(record_path)[0].metric("bits_per_weight") == pytest.approx(4.75)
    layers = json.loads((out / QCONFIG_FILE).read_text())["layers"]
    assert len(layers) == 14
    assert all(s == {"bits": 4, "symmetric": False, "granularity": "group:32", "act": None} for s in layers.values())


def test_quantize_w8a8_and_keep_fp32(capsys, llama_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "w8a8"
    code, _, _ = run(capsys, "quantize", llama_folder, "--act-bits", "8", "--keep-fp32", "--out", out)
    assert code == 0
    qconfig = json.loads((out / QCONFIG_FILE).read_text())
    assert qconfig["float_dtype"] == "float32"
    assert qconfig["layers"]["model.layers.1.self_attn.o_proj"]["act"]["bits"] == 8


def test_quantize_with_clipped_or_asymmetric_activations_and_what_it_refuses(capsys, llama_folder: Path,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "w8a4"
    code, _, _ = run(capsys, "quantize", llama_folder, "--act-bits", "4", "--act-clip", "0.9", "--out", out)
    assert code == 0
    assert json.loads((out / QCONFIG_FILE).read_text())["layers"]["model.layers.1.self_attn.o_proj"]["act"]["clip"] \
        == pytest.approx(0.9)
    code, _, _ = run(capsys, "quantize", llama_folder, "--act-bits", "4", "--act-clip", "search", "--out",
                     tmp_path / "searched")
    assert code == 0
    act = json.loads((tmp_path / "searched" / QCONFIG_FILE).read_text())["layers"]["model.layers.0.mlp.up_proj"]["act"]
    assert act["clip_search"] is True and "clip" not in act
    code, _, err = run(capsys, "export", tmp_path / "searched", "--to", "gguf", "--out", tmp_path / "s.gguf")
    assert_one_line_error(code, err, "clips its activations (--act-clip search)")
    with pytest.raises(SystemExit):  # argparse's own usage error, naming the option and what it takes
        run(capsys, "quantize", llama_folder, "--act-bits", "4", "--act-clip", "most", "--out", tmp_path / "bad")
    err = capsys.readouterr().err
    assert "--act-clip" in err and "'search'" in err
    code, _, _ = run(capsys, "quantize", llama_folder, "--act-bits", "4", "--act-asym", "--out", tmp_path / "aasym")
    assert code == 0
    act = json.loads((tmp_path / "aasym" / QCONFIG_FILE).read_text())["layers"]["model.layers.0.mlp.up_proj"]["act"]
    assert act["symmetric"] is False and "clip" not in act
    code, _, err = run(capsys, "export", out, "--to", "compressed-tensors", "--out", tmp_path / "ct")
    assert_one_line_error(code, err, "clips its activations", "--act-clip")
    code, _, _ = run(capsys, "quantize", llama_folder, "--act-bits", "4", "--act-sinks", "1", "--out", tmp_path / "s")
    assert code == 0
    code, _, err = run(capsys, "export", tmp_path / "s", "--to", "compressed-tensors", "--out", tmp_path / "ct")
    assert_one_line_error(code, err, "in 8 bits", "--act-sinks")
    assert not (tmp_path / "ct").exists()
    for args, words in ((["--act-clip", "0.9"], ("--act-bits",)), (["--act-bits", "4", "--act-clip", "1.5"],
                                                                    ("clip ratio", "(0, 1]")),
                        (["--act-bits", "8", "--act-sinks", "1"], ("sink tokens", "--act-bits 4"))):
        code, _, err = run(capsys, "quantize", llama_folder, *args, "--out", tmp_path / "bad")
        assert_one_line_error(code, err, *words)
    assert not (tmp_path / "bad").exists()


def test_quantize_with_activation_groups_exports_them_or_refuses(capsys, llama_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "grouped"
    code, _, _ = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--act-bits", "4",
                     "--act-group-size", "32", "--out", out)
    assert code == 0
    act = json.loads((out / QCONFIG_FILE).read_text())["layers"]["model.layers.0.mlp.down_proj"]["act"]
    assert act["granularity"] == "group:32" and act["bits"] == 4
    code, _, _ = run(capsys, "export", out, "--to", "compressed-tensors", "--out", tmp_path / "ct")
    assert code == 0
    groups = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    inputs = [group["input_activations"] for group in groups.values()]
    assert inputs and all(a["strategy"] == "group" and a["group_size"] == 32 and a["dynamic"] for a in inputs)
    w8 = tmp_path / "w4a8"
    assert run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--act-bits", "8",
               "--act-group-size", "32", "--out", w8)[0] == 0
    code, _, err = run(capsys, "export", w8, "--to", "onnx", "--out", tmp_path / "m.onnx")
    assert_one_line_error(code, err, "per token per 32 channels", "--act-group-size")
    assert not (tmp_path / "m.onnx").exists()
    for args, words in ((["--group-size", "64"], ("weight groups of the same size", "--group-size 32")),
                        ([], ("one scale a row", "--group-size 32"))):
        code, _, err = run(capsys, "quantize", llama_folder, "--bits", "4", *args, "--act-bits", "4",
                           "--act-group-size", "32", "--out", tmp_path / "bad")
        assert_one_line_error(code, err, *words)
    code, _, err = run(capsys, "quantize", llama_folder, "--bits", "4", "--group-size", "32", "--act-group-size",
                       "32", "--out", tmp_path / "bad")
    assert_one_line_error(code, err, "--act-group-size", "--act-bits")
    assert not (tmp_path / "bad").exists()


def test_quantize_with_a_plan_file(capsys, llama_folder: Path, tmp_path: Path) -> None:
    plan = lq.Plan((lq.Rule(r".*\.mlp\..*", lq.parse_scheme("w4a16-g64")), lq.Rule(".*", lq.W8A16)))
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "mixed"
    assert run(capsys, "quantize", llama_folder, "--plan", tmp_path / "plan.json", "--out", out)[0] == 0
    layers = json.loads((out / QCONFIG_FILE).read_text())["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["bits"] == 4
    assert layers["model.layers.0.self_attn.q_proj"]["bits"] == 8


# eval --------------------------------------------------------------------------------------------------------


def test_eval_checkpoint_against_its_source(capsys, checkpoint: Path, llama_folder: Path, wiki_text: Path,
                                            tmp_path: Path) -> None:
    record_path = tmp_path / "e.json"
    code, stdout, _ = run(capsys, "eval", checkpoint, "--text", wiki_text, *EVAL_ARGS, "--json", record_path)
    assert code == 0
    match = re.search(r"ppl ([\d.]+) over (\d+) tokens \((\d+) windows of 32, file wiki\.txt\); reference ppl "
                      r"([\d.]+), KL ([\d.]+), top-1 ([\d.]+)%", stdout)
    assert match, stdout
    [rec] = read_records(record_path)
    assert rec.kind == "eval"
    assert rec.model == str(checkpoint)
    m, p = rec.metrics, rec.protocol
    assert {"ppl", "kld", "top1", "tokens", "windows", "nll", "ppl_reference", "bits_per_weight"} <= set(m)
    assert m["tokens"] == 3 * 31 == int(match.group(2))
    assert m["windows"] == 3 == int(match.group(3))
    assert float(match.group(1)) == pytest.approx(m["ppl"], abs=1e-4)
    assert 0 < m["kld"] < 0.01
    assert 0.9 < m["top1"] <= 1.0
    assert p["text_sha256"] == hashlib.sha256(wiki_text.read_bytes()).hexdigest()
    assert p["seqlen"] == 32 and p["max_windows"] == 3 and p["bos"] is False
    # The reference is the unquantized folder the checkpoint came from.
    base, tokenizer = lq.load_model(llama_folder)
    ref = lq.evaluate(base, tokenizer, str(wiki_text), 32, 3, progress=False).metric("ppl")
    assert m["ppl_reference"] == pytest.approx(ref, rel=1e-6)


def test_eval_without_reference_and_of_a_plain_folder(capsys, checkpoint: Path, llama_folder: Path,
                                                      wiki_text: Path) -> None:
    code, stdout, _ = run(capsys, "eval", checkpoint, "--text", wiki_text, *EVAL_ARGS, "--no-reference")
    assert code == 0 and stdout.startswith("ppl ") and "KL" not in stdout
    code, stdout, _ = run(capsys, "eval", llama_folder, "--text", wiki_text, *EVAL_ARGS)
    assert code == 0 and stdout.startswith("ppl ") and "KL" not in stdout


# compare -----------------------------------------------------------------------------------------------------


def test_compare_prints_a_table_and_writes_records(capsys, llama_folder: Path, wiki_text: Path,
                                                   tmp_path: Path) -> None:
    record_path = tmp_path / "c.json"
    code, stdout, _ = run(capsys, "compare", llama_folder, "--schemes", "w8a16,w4a16-g32-asym", "--text", wiki_text,
                          *EVAL_ARGS, "--json", record_path)
    assert code == 0
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    assert all(h in lines[header] for h in ("bits/w", "ppl", "KL", "top-1 %"))
    rows = [line.split()[0] for line in lines[header + 2:] if line.strip()]
    assert rows == ["fp32", "w8a16", "w4a16-g32-asym"]
    assert "3 windows of 32 tokens" in stdout
    records = read_records(record_path)
    assert [r.kind for r in records] == ["compare"] * 3
    assert [r.metric("scheme") for r in records] == rows
    fp32, w8, w4 = (r.metrics for r in records)
    assert fp32["kld"] == 0 and fp32["top1"] == 1.0 and fp32["bits_per_weight"] == 32.0
    assert w4["bits_per_weight"] == pytest.approx(4.75)
    assert 8 < w8["bits_per_weight"] < 8.5
    assert 0 < w8["kld"] < w4["kld"]
    assert w4["checkpoint_bytes"] < w8["checkpoint_bytes"] < fp32["checkpoint_bytes"]
    assert all(r.protocol["text_sha256"] == hashlib.sha256(wiki_text.read_bytes()).hexdigest() for r in records)
    assert all(r.metric("tokens") == 93 for r in records)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "wiki.txt"]  # no checkpoints left here


def test_compare_keeps_checkpoints_in_workdir(capsys, llama_folder: Path, wiki_text: Path, tmp_path: Path) -> None:
    code, _, _ = run(capsys, "compare", llama_folder, "--schemes", "w8a8", "--text", wiki_text, *EVAL_ARGS,
                     "--workdir", tmp_path / "work")
    assert code == 0
    model, _ = lq.load(tmp_path / "work" / "w8a8")
    assert model.model.layers[0].mlp.up_proj.scheme == lq.W8A8


# KV cache ----------------------------------------------------------------------------------------------------




KV_CALIB = ["--calib-samples", "4", "--calib-seqlen", "32"]


def test_quantize_with_a_quantized_kv_cache_then_eval_uses_it(capsys, llama_folder: Path, wiki_text: Path,
                                                               calib_text: Path, tmp_path: Path) -> None:
    out = tmp_path / "kv"
    code, stdout, _ = run(capsys, "quantize", llama_folder, "--bits", "8", "--kv-bits", "4", "--kv-key-channels",
                          "1", "--kv-key-block", "16", "--calib", calib_text, *KV_CALIB, "--out", out)
    assert code == 0 and "KV cache k4v4-o0.01-s8-c1-b16" in stdout
    qconfig = json.loads((out / QCONFIG_FILE).read_text())
    assert qconfig["kv_cache"]["calibrated"] is True and qconfig["kv_cache"]["config"]["key_channels"] == 1
    assert qconfig["kv_cache"]["config"]["key_block"] == 16
    assert (out / "kv_cache.safetensors").is_file()
    code, with_kv, _ = run(capsys, "eval", out, "--text", wiki_text, *EVAL_ARGS, "--json", tmp_path / "a.json")
    assert code == 0 and "KV cache k4v4" in with_kv
    code, without, _ = run(capsys, "eval", out, "--text", wiki_text, *EVAL_ARGS, "--no-kv-cache",
                           "--json", tmp_path / "b.json")
    assert code == 0 and "KV cache" not in without
    a, b = (read_records(tmp_path / name)[0] for name in ("a.json", "b.json"))
    assert a.metric("kv_cache") == "k4v4-o0.01-s8-c1-b16" and a.protocol["kv_cache"]["calibrated"] is True
    assert a.metric("kld") > b.metric("kld")  # the quantized cache costs something on top of the weights


def test_eval_a_plain_model_with_an_online_kv_cache(capsys, llama_folder: Path, wiki_text: Path) -> None:
    code, stdout, _ = run(capsys, "eval", llama_folder, "--text", wiki_text, *EVAL_ARGS, "--kv-bits", "8",
                          "--kv-sinks", "2", "--kv-outliers", "0", "--kv-key-block", "0")
    assert code == 0 and "KV cache k8v8-s2\n" in stdout


def test_eval_with_compact_kv_side_information(capsys, llama_folder: Path, wiki_text: Path, calib_text: Path,
                                               tmp_path: Path) -> None:
    options = ["--kv-bits", "3", "--kv-key-block", "8", "--kv-key-channels", "8", "--kv-outliers", "0.1"]
    records = {}
    for name, extra in (("plain", []), ("compact", ["--kv-compact"])):
        code, _, _ = run(capsys, "eval", llama_folder, "--text", wiki_text, *EVAL_ARGS, *options, *extra,
                         "--calib", calib_text, *KV_CALIB, "--json", tmp_path / f"{name}.json")
        assert code == 0
        records[name] = read_records(tmp_path / f"{name}.json")[0]
    assert records["compact"].metric("kv_cache") == "k3v3-o0.1-s8-c8-b8-compact"
    assert records["plain"].metric("ppl") != records["compact"].metric("ppl")
    code, _, err = run(capsys, "eval", llama_folder, "--text", wiki_text, *EVAL_ARGS, "--kv-bits", "3",
                       "--kv-key-block", "0", "--kv-compact")
    assert_one_line_error(code, err, "--kv-key-block", "--kv-compact")


def test_compare_with_a_kv_cache(capsys, llama_folder: Path, wiki_text: Path, calib_text: Path,
                                 tmp_path: Path) -> None:
    record_path = tmp_path / "c.json"
    code, stdout, _ = run(capsys, "compare", llama_folder, "--schemes", "w8a16", "--text", wiki_text, *EVAL_ARGS,
                          "--kv-bits", "3", "--calib", calib_text, *KV_CALIB, "--json", record_path)
    assert code == 0 and "KV cache k3v3-o0.047-s8-c2-b16" in stdout  # the 3-bit defaults
    fp32, w8 = (r.metrics for r in read_records(record_path))
    assert "kv_cache" not in fp32 and w8["kv_cache"] == "k3v3-o0.047-s8-c2-b16" and w8["kld"] > 0


@pytest.mark.parametrize("args, needles", [
    (["--kv-bits", "5"], ["KV-cache key bit width 5"]),
    (["--kv-bits", "4", "--kv-outliers", "0.9"], ["outlier share", "0.9"]),
    (["--kv-bits", "4", "--kv-sinks", "-1"], ["sinks"]),
])
def test_kv_option_errors(capsys, llama_folder: Path, tmp_path: Path, args: list[str], needles: list[str]) -> None:
    code, _, err = run(capsys, "quantize", llama_folder, *args, "--out", tmp_path / "out")
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()


def test_quantize_preset_is_its_recipe_and_refuses_contradicting_options(capsys, llama_folder: Path, wiki_text: Path,
                                                                         tmp_path: Path) -> None:
    """`--preset w4a8-g64` quantizes with the recipe the presets table names, on the shipped calibration text unless
    --calib says otherwise, and takes what the preset leaves open (here the LM head's scheme); an option that
    contradicts it is a one-line error."""
    from llmeasyquant.presets import QUANTIZE_PRESETS, preset

    chosen = preset("w4a8-g64")
    out = tmp_path / "preset"
    assert main(["--quiet", "quantize", str(llama_folder), "--preset", "w4a8-g64", "--calib", str(wiki_text),
                 "--calib-samples", "2", "--calib-seqlen", "32", "--lm-head", "w8a16", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert [r["method"] for r in model.llmeasyquant.recipe] == chosen.method.split("+")
    assert (input_transform_of(model.model.layers[0].mlp.down_proj) is not None) == chosen.online_rotation
    layers = quantized_layers(model)
    assert layers["lm_head"].scheme == lq.parse_scheme("w8a16")
    assert {layer.scheme.name for name, layer in layers.items() if name != "lm_head"} == {chosen.scheme}
    with pytest.raises(SystemExit) as info:  # the presets and their measured figures are listed in --help
        main(["quantize", "--help"])
    assert info.value.code == 0
    listed = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    assert all("".join(f"{name}: {p.options} ({p.measured})".split()) in listed for name, p in QUANTIZE_PRESETS.items())
    code, _, err = run(capsys, "quantize", llama_folder, "--preset", "w4a8-g64", "--bits", "8", "--lm-head", "w8a16",
                       "--out", tmp_path / "other")
    assert_one_line_error(code, err, "--preset w4a8-g64 sets the recipe", "drop --bits or drop --preset")
    assert not (tmp_path / "other").exists()


def test_quantize_w4a4_preset_carries_its_rotation_activations_and_kv_cache(llama_folder: Path, wiki_text: Path,
                                                                           tmp_path: Path) -> None:
    """Every option `--preset w4a4-kv4` stands for reaches the checkpoint: the online transforms, the activation
    scheme (bits, zero points, clip) and the 4-bit KV cache."""
    from llmeasyquant.presets import preset

    chosen = preset("w4a4-kv4")
    out = tmp_path / "w4a4"
    assert main(["--quiet", "quantize", str(llama_folder), "--preset", "w4a4-kv4", "--calib", str(wiki_text),
                 "--calib-samples", "2", "--calib-seqlen", "32", "--out", str(out)]) == 0
    model, _ = lq.load(out)
    block = model.model.layers[0]
    assert (input_transform_of(block.mlp.down_proj) is not None) == chosen.online_rotation
    assert (input_transform_of(block.self_attn.o_proj) is not None) == chosen.online_attention
    assert {layer.scheme for layer in quantized_layers(model).values()} == {lq.parse_scheme(chosen.scheme)}
    kv = json.loads((out / QCONFIG_FILE).read_text())["kv_cache"]["config"]
    assert kv["key_bits"] == kv["value_bits"] == chosen.kv_bits


# errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needles", [
    (["--method", "foo"], ["unknown method 'foo'", "rtn"]),
    (["--bits", "5"], ["bit width 5"]),
    (["--group-size", "0"], ["group size must be a positive integer, got 0"]),
    (["--group-size", "-3"], ["group size must be a positive integer, got -3"]),
])
def test_quantize_option_errors(capsys, llama_folder: Path, tmp_path: Path, args: list[str],
                                needles: list[str]) -> None:
    code, _, err = run(capsys, "quantize", llama_folder, *args, "--out", tmp_path / "out")
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()


def test_missing_model_path(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "quantize", "./does-not-exist", "--out", tmp_path / "out")
    assert_one_line_error(code, err, "does-not-exist")
    code, _, err = run(capsys, "eval", "./does-not-exist", "--text", "x.txt")
    assert_one_line_error(code, err, "does-not-exist")


def test_eval_missing_text_file(capsys, checkpoint: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "eval", checkpoint, "--text", tmp_path / "nope.txt", *EVAL_ARGS)
    assert_one_line_error(code, err, "nope.txt does not exist")


def test_eval_text_too_short_for_one_window(capsys, checkpoint: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.\n")
    code, _, err = run(capsys, "eval", checkpoint, "--text", short, "--seqlen", "512")
    assert_one_line_error(code, err, "fewer than one window of 512", "--seqlen")


def test_eval_empty_text_file(capsys, checkpoint: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run(capsys, "eval", checkpoint, "--text", empty, *EVAL_ARGS)
    assert_one_line_error(code, err, "is empty")


def test_eval_of_a_corrupt_checkpoint(capsys, checkpoint: Path, wiki_text: Path, tmp_path: Path) -> None:
    import shutil

    bad = Path(shutil.copytree(checkpoint, tmp_path / "bad"))
    (bad / WEIGHTS_FILE).write_bytes(b"\x00\x01 definitely not safetensors")
    code, _, err = run(capsys, "eval", bad, "--text", wiki_text, *EVAL_ARGS)
    assert_one_line_error(code, err, "is corrupt", WEIGHTS_FILE)


def test_compare_errors(capsys, llama_folder: Path, wiki_text: Path) -> None:
    code, _, err = run(capsys, "compare", llama_folder, "--schemes", "w8a16,w5a16", "--text", wiki_text, *EVAL_ARGS)
    assert_one_line_error(code, err, "bit width 5")
    code, _, err = run(capsys, "compare", llama_folder, "--schemes", "nonsense", "--text", wiki_text, *EVAL_ARGS)
    assert_one_line_error(code, err, "cannot read scheme 'nonsense'")
    code, _, err = run(capsys, "compare", llama_folder, "--schemes", " , ", "--text", wiki_text, *EVAL_ARGS)
    assert_one_line_error(code, err, "--schemes is empty")
    code, _, err = run(capsys, "compare", llama_folder, "--method", "foo", "--text", wiki_text, *EVAL_ARGS)
    assert_one_line_error(code, err, "unknown method 'foo'")


def test_debug_reraises(llama_folder: Path, checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(lq.ConfigError, match="unknown method"):
        main(["--debug", "--quiet", "quantize", str(llama_folder), "--method", "foo", "--out", str(tmp_path / "o")])
    with pytest.raises(lq.ConfigError, match="bit width 5"):
        main(["--debug", "quantize", str(llama_folder), "--bits", "5", "--out", str(tmp_path / "o")])
    with pytest.raises(lq.OutputExistsError):
        main(["--debug", "quantize", str(llama_folder), "--out", str(checkpoint)])
    with pytest.raises(lq.DataError, match="does not exist"):
        main(["--debug", "eval", str(checkpoint), "--text", str(tmp_path / "nope.txt")])


def test_threads_option(capsys, checkpoint: Path, wiki_text: Path) -> None:
    threads = torch.get_num_threads()
    try:
        code, _, _ = run(capsys, "--threads", "1", "eval", checkpoint, "--text", wiki_text, *EVAL_ARGS,
                              "--no-reference")
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_quiet_silences_progress_bars(capsys, checkpoint: Path, wiki_text: Path) -> None:
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # the default, whatever the environment running the tests says
    try:
        code, stdout, err = run(capsys, "eval", checkpoint, "--text", wiki_text, *EVAL_ARGS)
    finally:
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    assert code == 0 and "KL" in stdout
    assert err == ""


def test_record_command_is_the_command_that_ran(capsys, llama_folder: Path, tmp_path: Path) -> None:
    out, record_path = tmp_path / "out", tmp_path / "q.json"
    code, _, _ = run(capsys, "quantize", llama_folder, "--bits", "8", "--out", out, "--json", record_path)
    assert code == 0
    command = read_records(record_path)[0].command
    # the paths as a record writes them: by name, not by this machine's folders
    assert f"quantize {llama_folder.name} --bits 8 --out {out.name} --json {record_path.name}" in command


# non-uniform grids ---------------------------------------------------------------------------------------------


def test_cli_grid_quantizes_rtn_and_gptq(llama_folder, wiki_text, tmp_path, capsys):
    out = tmp_path / "nf4"
    assert main(["--quiet", "quantize", str(llama_folder), "--bits", "4", "--group-size", "32", "--grid", "nf4",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    schemes = {m.scheme.name for m in model.modules() if isinstance(m, lq.QuantLinear)}
    assert schemes == {"w4a16-g32-nf4"}
    gptq = tmp_path / "gptq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "4", "--group-size", "32",
                 "--grid", "learned", "--calib", str(wiki_text), "--calib-samples", "2", "--calib-seqlen", "32",
                 "--out", str(gptq)]) == 0
    layers = [m for m in lq.load(gptq)[0].modules() if isinstance(m, lq.QuantLinear)]
    assert {m.scheme.grid for m in layers} == {"learned"} and all(m.levels is not None for m in layers)


def test_cli_three_bit_learned_grid_quantizes_and_evaluates(llama_folder, wiki_text, tmp_path, capsys):
    out = tmp_path / "w3"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "3", "--group-size", "32",
                 "--grid", "learned", "--calib", str(wiki_text), "--calib-samples", "2", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    layers = [m for m in lq.load(out)[0].modules() if isinstance(m, lq.QuantLinear)]
    assert {m.scheme.name for m in layers} == {"w3a16-g32-learned"}
    assert all(tuple(m.levels.shape) == (m.out_features, 8) for m in layers)
    assert main(["--quiet", "eval", str(out), "--text", str(wiki_text), "--max-windows", "2", "--seqlen", "32"]) == 0


def test_cli_grid_needs_four_bits(llama_folder, tmp_path, capsys):
    assert main(["--quiet", "quantize", str(llama_folder), "--grid", "nf4", "--out", str(tmp_path / "x")]) == 2
    assert "--bits 4" in capsys.readouterr().err
    assert main(["--quiet", "quantize", str(llama_folder), "--bits", "2", "--grid", "learned",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--bits 3 or 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(llama_folder), "--bits", "4", "--grid", "nf5", "--out", str(tmp_path / "y")])


def test_cli_help_lists_grid(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "--grid" in capsys.readouterr().out
