"""Whole-model loads that cannot fit are refused before they start, with the ways around it."""

from __future__ import annotations

import pytest
import torch

from cli_helpers import assert_one_line_error, run
from conftest import save_hf_folders
from llmeasyquant.errors import ModelLoadError
from llmeasyquant.models import load
from llmeasyquant.models.load import folder_elements, load_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> object:
    return save_hf_folders(tmp_path_factory.mktemp("load"), tiny_tokenizer)["llama"]


def test_the_elements_of_a_folder_come_from_the_headers(folder):
    model, _ = load_model(str(folder))
    assert folder_elements(folder) == sum(p.numel() for p in model.parameters())  # own head: nothing tied


def test_a_model_larger_than_the_memory_available_is_refused_with_the_ways_around(folder, monkeypatch):
    needed = folder_elements(folder) * 4  # fp32
    monkeypatch.setattr(load, "available_bytes", lambda: needed - 1)
    with pytest.raises(ModelLoadError, match=r"--stream.*--no-reference.*--baseline none"):
        load_model(str(folder))
    with pytest.raises(ModelLoadError, match="needs about"):
        load_model(str(folder), dtype=torch.float64)
    monkeypatch.setattr(load, "available_bytes", lambda: needed)
    load_model(str(folder))
    with pytest.raises(ModelLoadError, match="needs about"):
        load_model(str(folder), dtype=torch.float64)  # twice the bytes
    monkeypatch.setattr(load, "available_bytes", lambda: None)  # not Linux: no check
    load_model(str(folder))


def test_the_cli_says_it_in_one_line(folder, monkeypatch, capsys):
    monkeypatch.setattr(load, "available_bytes", lambda: 1)
    code, _, err = run(capsys, "eval", folder, "--max-windows", "1")
    assert_one_line_error(code, err, "needs about", "--no-reference")
