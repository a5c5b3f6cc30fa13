"""`llmeasyquant export`: each format written from a checkpoint folder and checked in its runtime (or the check
skipped with the install command when the runtime is absent), and the one-line errors."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from tests.cli_helpers import assert_one_line_error, run

from llmeasyquant.record import read_records

RUNTIME_MODULE = {"compressed-tensors": "compressed_tensors", "gguf": "llama_cpp", "onnx": "onnxruntime"}


@pytest.fixture(scope="module")
def checkpoint(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmeasyquant.cli import main

    out = tmp_path_factory.mktemp("export-cli") / "ckpt"
    assert main(["--quiet", "quantize", str(llama_folder), "--bits", "4", "--group-size", "32", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gguf", "onnx"])
def test_export_writes_and_checks(capsys, checkpoint: Path, wiki_text: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / ("model.gguf" if fmt == "gguf" else "model")
    code, stdout, _ = run(capsys, "export", checkpoint, "--to", fmt, "--out", out, "--text", wiki_text, "--seqlen",
                          "32", "--max-windows", "2", "--json", tmp_path / "rec.json")
    assert code == 0, stdout
    assert f"wrote {fmt} {out}" in stdout and out.exists()
    [rec] = read_records(tmp_path / "rec.json")
    assert rec.kind == "export" and rec.metric("format") == fmt and rec.protocol["seqlen"] == 32
    check = rec.metric("check")
    if importlib.util.find_spec(RUNTIME_MODULE[fmt]) is None:
        assert "skipped" in check and "pip install" in check["skipped"] and "skipped" in stdout
    else:
        assert check["windows"] == 2 and abs(check["ppl_rel_diff_pct"]) < 1.0, check
        assert f"ppl {check['ppl_runtime']:.4f} vs ours" in stdout


def test_export_errors(capsys, checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "ct"
    assert run(capsys, "export", checkpoint, "--to", "compressed-tensors", "--out", out, "--no-check")[0] == 0
    code, _, err = run(capsys, "export", checkpoint, "--to", "compressed-tensors", "--out", out, "--no-check")
    assert_one_line_error(code, err, "exists already", "--force")
    assert run(capsys, "export", checkpoint, "--to", "compressed-tensors", "--out", out, "--no-check",
               "--force")[0] == 0
    code, _, err = run(capsys, "export", tmp_path / "nothing", "--to", "gguf", "--out", tmp_path / "x.gguf")
    assert_one_line_error(code, err, "no checkpoint folder")
    code, _, err = run(capsys, "export", checkpoint, "--to", "gguf", "--out", tmp_path, "--force", "--no-check")
    assert_one_line_error(code, err, "is a folder")


def test_check_is_skipped_with_the_install_command_when_the_runtime_is_missing(monkeypatch, capsys, checkpoint: Path,
                                                                               wiki_text: Path,
                                                                               tmp_path: Path) -> None:
    from llmeasyquant.export import formats
    from llmeasyquant.export.common import MissingRuntimeError

    def absent(path, seqlen, threads):
        raise MissingRuntimeError("llama_cpp is not installed; install it with: pip install llama-cpp-python")

    real = formats.FORMATS["gguf"]
    monkeypatch.setitem(formats.FORMATS, "gguf", lambda: dataclasses.replace(real(), open_runtime=absent))
    code, stdout, _ = run(capsys, "export", checkpoint, "--to", "gguf", "--out", tmp_path / "m.gguf", "--text",
                          wiki_text, "--seqlen", "32", "--max-windows", "1")
    assert code == 0
    assert "check in llama.cpp (llama-cpp-python) skipped: llama_cpp is not installed" in stdout
    assert "pip install llama-cpp-python" in stdout
