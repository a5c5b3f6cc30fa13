"""The HTML report: self-contained (no external URL, every image a data: PNG), captions naming the protocol, the
table escaped, records.json round-tripping, the errors, the CLI line, and the page as a real browser renders it."""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import io
import json
import random
import re
from pathlib import Path

import pytest

from llmeasyquant.errors import DataError, OutputExistsError
from llmeasyquant.record import Record
from llmeasyquant.report import html as html_report
from llmeasyquant.report.browser import find_chromium, images_loaded, screenshot
from llmeasyquant.report.html import read_records, render_html, write_report, write_report_html

STEMS = ("weight_distributions", "quality", "latency_breakdown", "radar", "error_heatmap", "error_violins",
         "weight_tsne", "context_scaling")
SHA = "3f2a9c01b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e"
LAYERS = [f"model.layers.{i}.{part}" for i in range(3) for part in
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")]
EVIL = "<script>alert(1)</script>"


def _row(rng: random.Random, method: str, scheme: str, bits: float, ppl: float) -> dict:
    quantized = method != "fp32"
    edges = [-0.1 + 0.01 * i for i in range(21)]
    return {
        "method": method, "scheme": scheme, "ppl": ppl, "ppl_delta_pct": 100 * (ppl / 20.0 - 1),
        "kld": 0.01 * bits if quantized else 0.0, "top1": 0.9 if quantized else 1.0,
        "quantize_s": 3.5 if quantized else 0.0, "checkpoint_bytes": int(bits * 135e6 / 8),
        "bits_per_weight": bits, "calib_samples": 64 if method in ("gptq", "awq") else 0,
        "decode_tok_s": None if method == "awq" else 40.0 + bits, "prefill_tok_s": 300.0, "peak_rss_mb": 900.0,
        "latency": {"load": 0.002, "quant": 0.001 if quantized else 0.0, "gemm": 0.01, "other": 0.005},
        "layer_errors": {name: rng.uniform(0.01, 0.1) for name in LAYERS} if quantized else None,
        "weight_hist": {"layer": LAYERS[5], "edges": edges, "float": [rng.randint(0, 100) for _ in range(20)],
                        "quantized": [rng.randint(0, 100) for _ in range(20)]},
        "weight_summaries": {name: [rng.gauss(0, 1) for _ in range(8)] for name in LAYERS},
        "context_ppl": {"128": ppl * 1.3, "256": ppl * 1.1, "512": ppl},
    }


def make_records() -> list[Record]:
    """fp32 and three methods, with every field of docs/compare_record.md."""
    rng = random.Random(0)
    rows = [_row(rng, "fp32", "fp32", 32.0, 20.0), _row(rng, "rtn", "w8a16", 8.25, 20.1),
            _row(rng, "gptq", "w4a16-g64", 4.5, 21.3), _row(rng, "awq", "w4a16-g128", 4.25, 21.0)]
    protocol = {"text_source": "file wiki.test.raw", "text_sha256": SHA, "seqlen": 512, "max_windows": 20,
                "windows": 20, "bos": False, "threads": 2, "seed": 0}
    return [Record("compare", "smollm2-135m", m, dict(protocol),
                   command="llmeasyquant compare smollm2-135m --methods rtn,gptq,awq --json out.json",
                   versions={"llmeasyquant": "0.1.0", "torch": "2.13.0", "python": "3.11.9"},
                   machine={"platform": "Linux-6.1-x86_64", "processor": "x86_64", "cpus": 16, "threads": 2})
            for m in rows]


def _json(records: list[Record] | Record) -> str:
    return json.dumps(records.to_dict() if isinstance(records, Record) else [r.to_dict() for r in records])


@pytest.fixture(scope="module")
def pngs() -> dict[str, bytes]:
    """One small real PNG per figure stem, drawn once with matplotlib."""
    plt = pytest.importorskip("matplotlib.pyplot")
    out = {}
    for n, stem in enumerate(STEMS):
        figure, axes = plt.subplots(figsize=(3, 2))
        axes.plot([0, 1, 2], [n, n + 1, n * 2])
        axes.set_title(stem)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=50)
        plt.close(figure)
        out[stem] = buffer.getvalue()
    return out


@pytest.fixture
def fake_figures(pngs: dict[str, bytes]):
    """A stand-in for compare_figures.write_figures: the same interface, the eight PNGs written at once."""
    def write_figures(records: list[Record], out_dir: Path) -> dict[str, Path]:
        assert records
        paths = {}
        for stem, data in pngs.items():
            paths[stem] = Path(out_dir) / f"{stem}.png"
            paths[stem].write_bytes(data)
        return paths
    return write_figures


@pytest.fixture
def report(tmp_path: Path, fake_figures) -> tuple[list[Record], Path]:
    records = make_records()
    return records, write_report(records, tmp_path / "rep", figures_fn=fake_figures)


def _figures(page: str) -> list[str]:
    return re.findall(r"<figure\b.*?</figure>", page, re.S)


def assert_self_contained(page: str) -> None:
    """No attribute or stylesheet can point outside the page, and every image is a data: URI holding a PNG."""
    refs = re.findall(r"""\b(?:src|href|srcset|action|poster|background)\s*=\s*["']?([^"'\s>]*)""", page, re.I)
    assert all(ref.startswith("data:") for ref in refs), refs
    assert not re.search(r"url\s*\(|@import|@font-face|https?://|<link\b|<script\b|<iframe\b", page, re.I)
    images = re.findall(r"<img\b[^>]*>", page)
    assert images
    for tag in images:
        src = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', tag)
        assert src, tag[:200]
        assert base64.b64decode(src.group(1), validate=True).startswith(b"\x89PNG\r\n\x1a\n")
        assert re.search(r'alt="[^"]+"', tag), tag[:200]


def test_report_is_self_contained(report: tuple[list[Record], Path]) -> None:
    _, path = report
    page = path.read_text(encoding="utf-8")
    assert_self_contained(page)
    assert len(re.findall(r"<img\b", page)) == len(STEMS)
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([*(f"{s}.png" for s in STEMS), "records.json",
                                                                    "report.html"])


def test_every_figure_caption_names_the_protocol(report: tuple[list[Record], Path]) -> None:
    page = report[1].read_text(encoding="utf-8")
    figures = _figures(page)
    assert [re.search(r'id="fig-([a-z_]+)"', f).group(1) for f in figures] == list(STEMS)
    for figure in figures:
        caption = re.search(r"<figcaption>(.*?)</figcaption>", figure, re.S).group(1)
        for needle in ("wiki.test.raw", SHA[:12], "20 windows × 512 tokens", "no BOS", "2 threads",
                       "Linux-6.1-x86_64", "torch 2.13.0", "llmeasyquant 0.1.0"):
            assert needle in caption, (needle, caption)


def test_table_values_commands_and_time(report: tuple[list[Record], Path]) -> None:
    page = report[1].read_text(encoding="utf-8")
    table = re.search(r"<table>.*?</table>", page, re.S).group(0)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    header = re.findall(r"<th>(.*?)</th>", rows[0])
    assert header == ["method", "scheme", "bits/weight", "checkpoint MB", "ppl", "Δppl %", "KL", "top-1 %",
                      "quantize s", "decode tok/s"]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows[1:]]
    assert [c[0] for c in cells] == ["fp32", "rtn", "gptq", "awq"]
    assert cells[2] == ["gptq", "w4a16-g64", "4.500", f"{4.5 * 135e6 / 8 / 2**20:.1f}", "21.300", "+6.50", "0.04500",
                        "90.00", "3.5", "44.5"]
    assert cells[3][-1] == "–"  # awq's decode speed was not measured
    assert "The records were produced by" in page and "--methods rtn,gptq,awq --json out.json" in page
    assert re.search(r"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", page)
    assert "different protocols" not in page


def test_record_strings_are_escaped(tmp_path: Path, fake_figures) -> None:
    records = make_records()
    records[1].metrics["method"] = EVIL
    records[1].protocol["text_source"] = 'file "a&b".txt'
    records[1] = dataclasses.replace(records[1], command=f"llmeasyquant compare --method '{EVIL}'")
    page = write_report(records, tmp_path / "rep", figures_fn=fake_figures, title="<b>T</b>").read_text()
    assert EVIL not in page and "<script" not in page and "<b>T</b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;b&gt;T&lt;/b&gt;" in page
    assert "file &quot;a&amp;b&quot;.txt" in page
    assert_self_contained(page)


def test_different_protocols_are_flagged(tmp_path: Path, fake_figures) -> None:
    records = make_records()
    records[3].protocol["seqlen"] = 2048
    page = write_report(records, tmp_path / "rep", figures_fn=fake_figures).read_text()
    assert "2 different protocols" in page
    assert "20 windows × 2048 tokens" in page and "<b>P2</b> (rows awq)" in page
    for figure in _figures(page):  # each caption gives both protocols
        assert "20 windows × 512 tokens" in figure and "20 windows × 2048 tokens" in figure
    assert re.findall(r"<td[^>]*>(P\d)</td>", page) == ["P1", "P1", "P1", "P2"]


def test_records_round_trip(report: tuple[list[Record], Path], tmp_path: Path) -> None:
    records, path = report
    assert read_records([path.parent / "records.json"]) == records
    assert read_records([path.parent]) == records  # a report folder regenerates its report
    single = tmp_path / "one.json"
    single.write_text(_json(records[1]))
    assert read_records([path.parent / "records.json", single]) == [*records, records[1]]


def test_read_records_keeps_records_with_metrics(tmp_path: Path) -> None:
    records = make_records()
    mixed = [records[0].to_dict(), {"kind": "compare", "metrics": {}}, {"note": "x"}, 3,
             {"kind": "export", "metrics": {"a": 1}}]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(mixed))
    assert read_records([path]) == [records[0]]


@pytest.mark.parametrize(("content", "needle"), [
    (None, "does not exist"), ("{not json", "not valid JSON"), ("[]", "no result records"),
    ('[{"kind": "compare"}]', "no result records"), ('"text"', "no result records"),
    ('[{"kind": "compare", "metrics": {"ppl": 1.0}}]', "item 0: the record has no 'model' field")])
def test_read_records_errors(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=needle) as info:
        read_records([path])
    assert str(path) in str(info.value) and "--json" in str(info.value)


def test_existing_output_needs_force(report: tuple[list[Record], Path], fake_figures) -> None:
    records, path = report
    before = path.read_text()
    with pytest.raises(OutputExistsError, match="--force"):
        write_report(records, path.parent, figures_fn=fake_figures)
    assert path.read_text() == before
    changed = copy.deepcopy(records)
    changed[0].metrics["method"] = "baseline"
    write_report(changed, path.parent, force=True, figures_fn=fake_figures)
    assert ">baseline<" in path.read_text()


def test_failed_figures_leave_nothing(tmp_path: Path) -> None:
    def broken(records: list[Record], out_dir: Path) -> dict[str, Path]:
        (out_dir / "x.png").write_bytes(b"not a png")
        return {"x": out_dir / "x.png"}
    with pytest.raises(DataError, match="not a PNG"):
        write_report(make_records(), tmp_path / "rep", figures_fn=broken)
    assert list(tmp_path.iterdir()) == []


def test_write_report_html_single_file(tmp_path: Path, fake_figures) -> None:
    path = write_report_html(make_records(), tmp_path / "report.html", figures_fn=fake_figures)
    assert list(tmp_path.iterdir()) == [path]
    assert_self_contained(path.read_text())
    with pytest.raises(OutputExistsError, match="--force"):
        write_report_html(make_records(), path, figures_fn=fake_figures)


def test_render_without_figures_and_with_sparse_records() -> None:
    sparse = [Record("eval", "m", {"ppl": 12.0}, {}),
              Record("quantize", "m", {"quantize_s": 2.0, "checkpoint_bytes": 2**20}, {}),
              Record("compare", "m", {"scheme": "w8a8", "top1": 0.5},  # as compare() writes
                     {"recipe": [{"method": "smoothquant", "alpha": 0.5}, {"method": "rtn"}]})]
    page = render_html(sparse, {}, "t")
    assert "No figures" in page and "No command recorded" in page and "different protocols" not in page
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", page, re.S)[1:]]
    assert rows[0][:2] == ["m", "–"] and rows[1][3] == "1.0" and "decode tok/s" not in page
    assert rows[2][:2] == ["smoothquant+rtn", "w8a8"] and rows[2][7] == "50.00"


def _cli(argv: list[str]) -> argparse.Namespace:
    from llmeasyquant.cli.report import add_report_parser

    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_report(tmp_path: Path, fake_figures, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from llmeasyquant.cli.report import cmd_report

    monkeypatch.setattr(html_report, "_default_figures_fn", lambda: fake_figures)
    records = make_records()
    (tmp_path / "a.json").write_text(_json(records[:2]))
    (tmp_path / "b.json").write_text(_json(records[2:]))
    out = tmp_path / "rep"
    cmd_report(_cli(["report", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out),
                     "--title", "My run"]))
    assert capsys.readouterr().out.strip() == f"wrote {out / 'report.html'} (8 figures, 4 rows)"
    assert "<h1>My run</h1>" in (out / "report.html").read_text()
    with pytest.raises(OutputExistsError, match="--force"):
        cmd_report(_cli(["report", str(tmp_path / "a.json"), "--out", str(out)]))
    cmd_report(_cli(["report", str(tmp_path / "a.json"), "--out", str(out), "--force"]))
    assert "(8 figures, 2 rows)" in capsys.readouterr().out


def test_cli_report_registered(tmp_path: Path, fake_figures, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Through `llmeasyquant report`: a one-line error for a missing file."""
    from tests.cli_helpers import assert_one_line_error, run

    from llmeasyquant.cli.main import COMMANDS

    assert "report" in COMMANDS
    monkeypatch.setattr(html_report, "_default_figures_fn", lambda: fake_figures)
    (tmp_path / "a.json").write_text(_json(make_records()))
    code, out, _ = run(capsys, "report", tmp_path / "a.json", "--out", tmp_path / "rep")
    assert code == 0 and "(8 figures, 4 rows)" in out
    code, _, err = run(capsys, "report", tmp_path / "missing.json", "--out", tmp_path / "rep2")
    assert_one_line_error(code, err, "missing.json", "does not exist")


def test_with_real_figures(tmp_path: Path) -> None:
    """The real compare_figures.write_figures: eight embedded figures, all captioned."""
    pytest.importorskip("matplotlib")
    from llmeasyquant.report import compare_figures

    path = write_report(make_records(), tmp_path / "rep")
    page = path.read_text()
    assert_self_contained(page)
    figures = _figures(page)
    assert len(figures) == len(compare_figures.FIGURES) == len(STEMS)
    for figure, (title, _) in zip(figures, compare_figures.FIGURES.values(), strict=True):
        assert f"{title}." in figure and "20 windows × 512 tokens" in figure


# ---- a real browser ---------------------------------------------------------------------------------------------

def _chromium() -> str:
    browser = find_chromium()
    if browser is None:
        pytest.skip("no Chromium to render the page with (apt-get install chromium)")
    return browser


def test_page_renders_in_chromium(report: tuple[list[Record], Path], tmp_path: Path) -> None:
    from PIL import Image

    browser = _chromium()
    page = report[1]
    shot = tmp_path / "shot.png"
    stderr = screenshot(browser, page, shot)
    assert shot.is_file() and shot.stat().st_size > 20_000, stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == (1200, 4000)
        assert len(image.convert("L").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 16  # not a blank page
    assert images_loaded(browser, page) == [True] * len(STEMS)
