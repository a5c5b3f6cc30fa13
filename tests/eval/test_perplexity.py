"""Evaluation protocol (windows, perplexity, fidelity), text sources, and result records."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import llmeasyquant as lq
from llmeasyquant.calibration.data import TextSource, consecutive_chunks, read_text_file, tokenize
from llmeasyquant.eval.fidelity import kl_sum, top1_matches
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows, make_windows, perplexity
from llmeasyquant.record import Record, read_records, write_records
from llmeasyquant.report.tables import COMPARE_COLUMNS, format_table, markdown_table

SEQLEN = 32


@pytest.fixture
def windows(tiny_tokenizer, wiki_text: Path) -> EvalWindows:
    return make_windows(tiny_tokenizer, read_text_file(wiki_text), SEQLEN, max_windows=4)


# windows -----------------------------------------------------------------------------------------------------


def test_windows_are_consecutive_chunks_without_bos(tiny_tokenizer, wiki_text: Path) -> None:
    source = read_text_file(wiki_text)
    w = make_windows(tiny_tokenizer, source, SEQLEN)
    text = wiki_text.read_text(encoding="utf-8")  # universal newlines, as Python reads text files
    assert "\r\n" in wiki_text.read_bytes().decode("utf-8") and "\r" not in text
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    n = len(ids) // SEQLEN
    assert n > 100
    assert w.ids.shape == (n, SEQLEN)
    assert w.ids.dtype == torch.long
    assert w.ids.flatten().tolist() == ids[: n * SEQLEN]  # non-overlapping, in order, last partial window dropped
    # The tokenizer does add BOS when asked; the protocol does not ask.
    assert tiny_tokenizer("x").input_ids[0] == tiny_tokenizer.bos_token_id
    assert w.ids[0, 0].item() == ids[0] != tiny_tokenizer.bos_token_id
    assert (w.ids == tiny_tokenizer.bos_token_id).sum() == 0


def test_protocol_records_what_was_measured(tiny_tokenizer, wiki_text: Path) -> None:
    w = make_windows(tiny_tokenizer, read_text_file(wiki_text), SEQLEN, max_windows=7)
    p = w.protocol
    assert p["text_sha256"] == hashlib.sha256(wiki_text.read_bytes()).hexdigest()
    assert p["seqlen"] == SEQLEN
    assert p["windows"] == 7
    assert p["max_windows"] == 7
    assert p["bos"] is False
    assert p["text_source"] == "file wiki.txt"
    assert "tokenizer" in p
    json.dumps(p)  # a record must be serialisable


@pytest.mark.parametrize("max_windows", [1, 5, 10**6])
def test_max_windows_takes_the_first_windows(tiny_tokenizer, wiki_text: Path, max_windows: int) -> None:
    source = read_text_file(wiki_text)
    every = make_windows(tiny_tokenizer, source, SEQLEN)
    some = make_windows(tiny_tokenizer, source, SEQLEN, max_windows)
    expected = min(max_windows, every.ids.shape[0])
    assert some.ids.shape == (expected, SEQLEN)
    assert torch.equal(some.ids, every.ids[:expected])
    assert some.protocol["windows"] == expected


@pytest.mark.parametrize("bad", [0, -2])
def test_max_windows_must_be_positive(tiny_tokenizer, wiki_text: Path, bad: int) -> None:
    with pytest.raises(ValueError, match="max_windows must be positive"):
        make_windows(tiny_tokenizer, read_text_file(wiki_text), SEQLEN, bad)


def test_consecutive_chunks() -> None:
    ids = torch.arange(10)
    assert consecutive_chunks(ids, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert consecutive_chunks(ids, 3, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert consecutive_chunks(ids, 10).tolist() == [list(range(10))]
    with pytest.raises(lq.DataError, match="fewer than one window"):
        consecutive_chunks(ids, 11)
    with pytest.raises(lq.DataError, match="at least 2 tokens"):
        consecutive_chunks(ids, 1)


# perplexity and fidelity -------------------------------------------------------------------------------------


def _nll_by_hand(model, ids: torch.Tensor) -> tuple[float, int]:
    total, count = 0.0, 0
    with torch.no_grad():
        for window in ids:
            logits = model(window[None]).logits[0, :-1]
            total += float(F.cross_entropy(logits.float(), window[1:], reduction="sum"))
            count += window.numel() - 1
    return total, count


def test_perplexity_is_exp_of_mean_nll(make_model, model_kind: str, windows: EvalWindows) -> None:
    model = make_model(model_kind)
    metrics = perplexity(model, windows, progress=False)
    total, count = _nll_by_hand(model, windows.ids)
    assert metrics["tokens"] == count == 4 * (SEQLEN - 1)
    assert metrics["windows"] == 4
    assert metrics["nll"] == pytest.approx(total / count, rel=1e-6)
    assert metrics["ppl"] == pytest.approx(math.exp(total / count), rel=1e-6)
    # A random model over 256 tokens is close to uniform: ppl near 256, far from 1.
    assert 100 < metrics["ppl"] < 600
    assert metrics["eval_s"] > 0


def test_model_against_itself_has_zero_kl_and_full_agreement(tiny_llama, windows: EvalWindows) -> None:
    twin = copy.deepcopy(tiny_llama)  # a separate forward pass, not the same logits reused
    m = evaluate_windows({"ref": tiny_llama, "twin": twin}, windows, reference="ref", progress=False)
    assert abs(m["twin"]["kld"]) < 1e-6
    assert m["twin"]["top1"] == 1.0
    assert m["twin"]["ppl"] == pytest.approx(m["ref"]["ppl"], rel=1e-6)
    assert m["ref"]["kld"] == 0.0 and m["ref"]["top1"] == 1.0


def test_two_bit_model_diverges_and_kl_matches_a_hand_computation(make_model, model_kind: str,
                                                                   windows: EvalWindows) -> None:
    base = make_model(model_kind)
    q = lq.quantize(copy.deepcopy(base), lq.RTN(), lq.parse_scheme("w2a16-g32-asym"), progress=False)
    m = evaluate_windows({"fp32": base, "w2": q}, windows, reference="fp32", progress=False)["w2"]
    assert m["kld"] > 1e-4
    assert m["top1"] < 1.0
    kl = matches = 0.0
    with torch.no_grad():
        for window in windows.ids:
            p = torch.log_softmax(base(window[None]).logits[0, :-1].float(), -1)
            r = torch.log_softmax(q(window[None]).logits[0, :-1].float(), -1)
            kl += float(F.kl_div(r, p, log_target=True, reduction="sum"))  # KL(P_fp32 || P_quant)
            matches += float((p.argmax(-1) == r.argmax(-1)).sum())
    assert m["kld"] == pytest.approx(kl / m["tokens"], rel=1e-4)
    assert m["top1"] == pytest.approx(matches / m["tokens"])


def test_fidelity_helpers() -> None:
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]]), -1)
    other = torch.log_softmax(torch.tensor([[0.0, 2.0, -1.0], [0.0, 3.0, 1.0]]), -1)
    expected = float((ref.exp() * (ref - other)).sum())
    assert kl_sum(ref, other) == pytest.approx(expected)
    assert kl_sum(ref, ref) == 0.0
    assert kl_sum(ref, other) > 0
    assert top1_matches(ref, other) == 1


def test_unknown_reference_is_rejected(tiny_llama, windows: EvalWindows) -> None:
    with pytest.raises(ValueError, match="reference 'nope'"):
        evaluate_windows({"a": tiny_llama}, windows, reference="nope", progress=False)


def test_evaluate_returns_an_eval_record(make_model, tiny_tokenizer, wiki_text: Path) -> None:
    base = make_model("llama")
    q = lq.quantize(copy.deepcopy(base), lq.RTN(), lq.W8A16, progress=False)
    rec = lq.evaluate(q, tiny_tokenizer, text=str(wiki_text), seqlen=SEQLEN, max_windows=3, reference=base,
                      name="tiny", progress=False)
    assert rec.kind == "eval" and rec.model == "tiny"
    m, p = rec.metrics, rec.protocol
    assert m["windows"] == 3 and m["tokens"] == 3 * (SEQLEN - 1)
    assert 0 < m["kld"] < 0.01 and m["top1"] > 0.9
    assert m["ppl_reference"] == pytest.approx(perplexity(base, make_windows(
        tiny_tokenizer, read_text_file(wiki_text), SEQLEN, 3), progress=False)["ppl"], rel=1e-6)
    assert 8 < m["bits_per_weight"] < 8.5
    assert p["text_sha256"] == hashlib.sha256(wiki_text.read_bytes()).hexdigest()
    assert p["seed"] == 0 and p["threads"] == torch.get_num_threads()
    json.dumps(rec.to_dict())
    unquantized = lq.evaluate(base, tiny_tokenizer, text=str(wiki_text), seqlen=SEQLEN, max_windows=3,
                              progress=False).metrics
    assert "kld" not in unquantized and "bits_per_weight" not in unquantized


# bad text ----------------------------------------------------------------------------------------------------


def test_text_shorter_than_one_window(tiny_llama, tiny_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("A short text of a few words.\n")
    tokens = len(tiny_tokenizer(path.read_text(), add_special_tokens=False).input_ids)
    assert tokens < 512
    with pytest.raises(lq.DataError, match=f"the text has {tokens} tokens, fewer than one window of 512"):
        make_windows(tiny_tokenizer, read_text_file(path), 512)
    with pytest.raises(lq.DataError, match="--seqlen"):
        lq.evaluate(tiny_llama, tiny_tokenizer, text=str(path), seqlen=512, progress=False)


@pytest.mark.parametrize("content", [b"", b"\n\n   \n"])
def test_empty_text_file(tiny_llama, tiny_tokenizer, tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(lq.DataError, match=r"empty\.txt is empty"):
        read_text_file(path)
    with pytest.raises(lq.DataError, match="is empty"):
        lq.evaluate(tiny_llama, tiny_tokenizer, text=str(path), seqlen=SEQLEN, progress=False)


def test_missing_text_file(tiny_llama, tiny_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "missing.txt"
    with pytest.raises(lq.DataError, match=r"missing\.txt does not exist"):
        read_text_file(path)
    with pytest.raises(lq.DataError, match="does not exist"):
        lq.evaluate(tiny_llama, tiny_tokenizer, text=str(path), seqlen=SEQLEN, progress=False)


def test_text_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(lq.DataError, match="not UTF-8"):
        read_text_file(path)


def test_text_is_read_with_universal_newlines_and_hashed_as_bytes(tmp_path: Path) -> None:
    path = tmp_path / "crlf.txt"
    data = "line one\r\nline two — ünïcode\r\n".encode()
    path.write_bytes(data)
    source = read_text_file(path)
    assert source.text == "line one\nline two — ünïcode\n"
    assert source.sha256 == hashlib.sha256(data).hexdigest()
    assert source.path == str(path.resolve())


def test_text_giving_no_tokens(tiny_tokenizer) -> None:
    with pytest.raises(lq.DataError, match="no tokens"):
        tokenize(tiny_tokenizer, "")
    with pytest.raises(lq.DataError):
        make_windows(tiny_tokenizer, TextSource(text="", description="nothing"), SEQLEN)


# records and tables ------------------------------------------------------------------------------------------


def test_record_shape() -> None:
    rec = Record.new("eval", "tiny", {"ppl": 12.5}, {"seqlen": 32}, command="llmeasyquant eval x")
    assert set(rec.to_dict()) == {"kind", "model", "metrics", "protocol", "command", "versions", "machine",
                                  "schema_version"}
    assert rec.kind == "eval" and rec.model == "tiny" and rec.command == "llmeasyquant eval x"
    assert rec.metrics == {"ppl": 12.5} and rec.protocol == {"seqlen": 32}
    assert rec.versions["llmeasyquant"] == lq.__version__
    assert rec.versions["torch"] == torch.__version__
    assert {"platform", "cpus", "threads"} <= set(rec.machine)
    assert isinstance(Record.new("bench", "m", {}, {}).command, str)
    json.dumps(rec.to_dict())


def test_write_records_writes_valid_json(tmp_path: Path) -> None:
    records = [Record.new("compare", "m", {"ppl": 1.5, "top1": None}, {"seqlen": 8}, command="c")]
    path = write_records(tmp_path / "sub" / "out.json", records)
    assert path == tmp_path / "sub" / "out.json"
    assert json.loads(path.read_text()) == [r.to_dict() for r in records]
    assert read_records(path) == records
    write_records(path, Record("eval", "m", {"ppl": 2.0}, {}))  # replaces; one record is one JSON object
    assert json.loads(path.read_text())["kind"] == "eval"
    assert os.listdir(path.parent) == ["out.json"]  # no temporary files left


def test_write_records_failure_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text('{"old": true}')
    with pytest.raises(TypeError):
        write_records(path, Record("eval", "m", {"bad": object()}, {}))
    assert json.loads(path.read_text()) == {"old": True}  # the old file is intact
    assert os.listdir(tmp_path) == ["out.json"]


def test_format_table() -> None:
    rows = [{"scheme": "fp32", "bits_per_weight": 32.0, "ppl": 10.0, "kld": 0.0, "top1_pct": 100.0},
            {"scheme": "w4a16-g32-asym", "bits_per_weight": 4.75, "ppl": 10.5, "ppl_delta_pct": 5.0,
             "kld": 0.01234, "top1_pct": 97.5, "quantize_s": float("nan")}]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, two rows
    for header, _, _ in COMPARE_COLUMNS:
        assert header in lines[0]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("fp32") and lines[3].startswith("w4a16-g32-asym")
    assert "4.750" in lines[3] and "+5.00" in lines[3] and "0.01234" in lines[3] and "97.50" in lines[3]
    assert lines[3].rstrip().endswith("-")  # NaN shows as '-'
    assert len({len(line) for line in lines}) == 1  # aligned columns
    md = markdown_table(rows)
    assert md.splitlines()[0].startswith("| scheme | bits/w")
    assert len(md.splitlines()) == 4
