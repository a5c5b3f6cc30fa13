"""The comparison as one self-contained HTML page: the figures embedded as data URIs, the results table, the
protocol every number came from and the commands that produced the records. No JavaScript, no external URL: the
page reads the same offline, from an e-mail attachment or years later."""

from __future__ import annotations

import base64
import datetime
import html
import logging
import math
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from llmeasyquant.errors import DataError
from llmeasyquant.infra.files import check_output, staged_folder, write_atomic
from llmeasyquant.record import Record, items_of, load_json, write_records

log = logging.getLogger(__name__)

KINDS = ("compare", "eval", "quantize", "bench")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MISSING = "–"
FIX = "pass the JSON file that `llmeasyquant compare --json PATH` (or eval / quantize --json) wrote"
# The browser itself refuses anything but inline styles and data: images, so the page cannot reach out.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

FiguresFn = Callable[[list[Record], Path], dict[str, Path]]


# ---- reading ----------------------------------------------------------------------------------------------------

def _records_in(path: Path) -> list[Record]:
    """The result records a file holds (one record or a list): items without metrics, or of another kind, are
    skipped with a warning; a record of a reported kind that lacks a field is an error (Record.from_dict)."""
    if path.is_dir():  # a report folder: its records.json regenerates the report
        path = path / "records.json"
    try:
        kept = []
        for i, (source, item) in enumerate(items_of(path, load_json(path))):
            if not isinstance(item, dict) or not isinstance(item.get("metrics"), dict) or not item["metrics"]:
                log.warning("%s: item %d is not a result record with metrics; skipped", path, i)
            elif item.get("kind") not in KINDS:
                log.warning("%s: item %d is a %r record, not one of %s; skipped", path, i, item.get("kind"), KINDS)
            else:
                kept.append(Record.from_dict(item, source))
    except DataError as exc:
        raise DataError(f"{exc}; {FIX}") from exc
    if not kept:
        raise DataError(f"{path} holds no result records with metrics (kinds {', '.join(KINDS)}); {FIX}")
    return kept


def read_records(paths: Iterable[str | Path]) -> list[Record]:
    """Every record with metrics from the JSON files, in order. Different protocols are allowed: the report says so."""
    records: list[Record] = []
    for path in map(Path, paths):
        records += _records_in(path.expanduser())
    if not records:
        raise DataError(f"no result files given; {FIX}")
    return records


# ---- what a record says -----------------------------------------------------------------------------------------

def row_name(record: Record) -> str:
    """The row's method: the metric, else the recipe in the protocol, else the scheme or the model."""
    p = record.protocol
    if record.metric("method") or p.get("method"):
        return str(record.metric("method") or p.get("method"))
    recipe = p.get("recipe")
    if isinstance(recipe, list) and recipe:
        return "+".join(str(step.get("method", "?")) if isinstance(step, dict) else str(step) for step in recipe)
    return str(record.metric("scheme") or record.model or record.kind or "?")


def _joined(values: dict, skip: Sequence[str] = ()) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items() if k not in skip and v not in (None, ""))


def describe_protocol(record: Record) -> str:
    """Text source and sha256 prefix, windows × seqlen, BOS, threads, machine, versions: what a number stands on."""
    p, machine = record.protocol, record.machine
    parts = []
    if p.get("text_source") or p.get("text_sha256"):
        sha = f" (sha256 {str(p['text_sha256'])[:12]}…)" if p.get("text_sha256") else ""
        parts.append(f"text {p.get('text_source') or 'unnamed'}{sha}")
    if p.get("windows") is not None or p.get("seqlen") is not None:
        windows, seqlen = (MISSING if v is None else v for v in (p.get("windows"), p.get("seqlen")))
        parts.append(f"{windows} windows × {seqlen} tokens")
    if "bos" in p:
        parts.append("BOS prepended" if p["bos"] else "no BOS")
    threads = p.get("threads", machine.get("threads"))
    if threads is not None:
        parts.append(f"{threads} threads")
    if _joined(machine, ("threads",)):
        parts.append(f"machine: {_joined(machine, ('threads',))}")
    if record.versions:
        parts.append(f"versions: {_joined(record.versions)}")
    return "; ".join(parts) or "no protocol recorded"


def protocol_groups(records: Sequence[Record]) -> list[tuple[str, list[int]]]:
    """Distinct protocol descriptions, each with the indices of its rows, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(describe_protocol(record), []).append(i)
    return list(groups.items())


def distinct_measurements(records: Sequence[Record]) -> int:
    """How many different (text, seqlen, windows, BOS) the rows were measured on (record.PROTOCOL_KEYS);
    quantize-only rows measured none. Machine, threads and versions are told apart by protocol_groups."""
    return len({key for key in (r.measured_on() for r in records) if any(v is not None for v in key)})


# ---- the results table ------------------------------------------------------------------------------------------

def _metric(name: str) -> Callable[[Record], object]:
    return lambda record: record.metric(name)


def _checkpoint_mb(record: Record) -> object:
    if record.metric("checkpoint_mb") is not None:
        return record.metric("checkpoint_mb")
    size = record.metric("checkpoint_bytes")
    return size / 2**20 if isinstance(size, int | float) else None


def _top1_pct(record: Record) -> object:
    if record.metric("top1_pct") is not None:
        return record.metric("top1_pct")
    top1 = record.metric("top1")
    return 100 * top1 if isinstance(top1, int | float) else None


COLUMNS: tuple[tuple[str, Callable[[Record], object], str], ...] = (  # (header, value of a record, number format)
    ("method", row_name, ""), ("scheme", _metric("scheme"), ""), ("bits/weight", _metric("bits_per_weight"), ".3f"),
    ("checkpoint MB", _checkpoint_mb, ".1f"), ("ppl", _metric("ppl"), ".3f"),
    ("Δppl %", _metric("ppl_delta_pct"), "+.2f"), ("KL", _metric("kld"), ".5f"), ("top-1 %", _top1_pct, ".2f"),
    ("quantize s", _metric("quantize_s"), ".1f"), ("decode tok/s", _metric("decode_tok_s"), ".1f"),
)
OPTIONAL_COLUMNS = ("decode tok/s",)  # shown only when some row measured it


def cell(value: object, fmt: str) -> str:
    """A table cell as escaped HTML text: numbers formatted, missing or NaN as an en dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, int | float) and not isinstance(value, bool) and fmt:
        return html.escape(format(value, fmt))
    return html.escape(str(value))


def _columns(records: Sequence[Record]) -> list[tuple[str, Callable[[Record], object], str]]:
    return [c for c in COLUMNS if c[0] not in OPTIONAL_COLUMNS or any(c[1](r) is not None for r in records)]


def _table(records: Sequence[Record], labels: dict[int, str]) -> str:
    columns = _columns(records)
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _, _ in columns) + ("<th>protocol</th>" if labels else "")
    rows = []
    for i, record in enumerate(records):
        cells = "".join(f'<td class="{"num" if f else "txt"}">{cell(get(record), f)}</td>' for _, get, f in columns)
        if labels:
            cells += f'<td class="txt">{labels[i]}</td>'
        rows.append(f"<tr>{cells}</tr>")
    return (f'<div class="scroll"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n' + "\n".join(rows)
            + "\n</tbody>\n</table></div>")


# ---- the page ---------------------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto; max-width: 1100px;
       padding: 0 1rem; color: #1b1b1b; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.2rem; margin-top: 2rem; }
.meta { color: #555; font-size: .9rem; }
.protocol { background: #f4f6f8; border-left: 4px solid #4a78b0; padding: .5rem .8rem; font-size: .9rem; }
.warn { background: #fff4e0; border-left: 4px solid #d08a00; padding: .5rem .8rem; }
table { border-collapse: collapse; margin: .8rem 0; font-size: .92rem; }
th, td { border-bottom: 1px solid #ddd; padding: .3rem .7rem; white-space: nowrap; }
.scroll { overflow-x: auto; }
th { background: #eef1f4; text-align: center; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 2rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #e3e3e3; }
figcaption { font-size: .88rem; color: #333; margin-top: .4rem; }
pre { background: #f6f6f6; padding: .5rem .8rem; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
"""


def _figure_titles() -> dict[str, str]:
    """Figure titles from compare_figures.FIGURES when that module can be imported; file stems otherwise."""
    try:
        from llmeasyquant.report.compare_figures import FIGURES
    except ImportError:
        return {}
    return {stem: str(entry[0]) for stem, entry in FIGURES.items()}


def _png_data_uri(stem: str, path: Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"figure {stem}: {path} does not exist; the figure function must write the PNG it returns")
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC):
        raise DataError(f"figure {stem}: {path} is not a PNG file; figures must be saved with format='png'")
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _protocol_text(records: Sequence[Record], groups: list[tuple[str, list[int]]]) -> str:
    """The protocol as escaped HTML: one sentence, or one per protocol with its rows."""
    if len(groups) == 1:
        return html.escape(groups[0][0])
    return "<br>".join(f"<b>P{n}</b> (rows {html.escape(', '.join(row_name(records[i]) for i in rows))}): "
                       f"{html.escape(text)}" for n, (text, rows) in enumerate(groups, 1))


def _figures(records: Sequence[Record], figures: dict[str, Path], groups: list[tuple[str, list[int]]]) -> str:
    titles, protocol = _figure_titles(), _protocol_text(records, groups)
    parts = []
    for n, (stem, path) in enumerate(figures.items(), 1):
        title = titles.get(stem) or stem.replace("_", " ")
        alt = html.escape(f"Figure {n}: {title}", quote=True)
        parts.append(f'<figure id="fig-{html.escape(stem, quote=True)}">\n'
                     f'<img src="{_png_data_uri(stem, path)}" alt="{alt}">\n'
                     f"<figcaption><b>Figure {n}. {html.escape(title)}.</b> Measured on: {protocol}</figcaption>\n"
                     "</figure>")
    return "\n".join(parts) if parts else "<p>No figures.</p>"


def _protocol_section(records: Sequence[Record], groups: list[tuple[str, list[int]]]) -> str:
    notes = []
    measured = distinct_measurements(records)
    if measured > 1:
        notes.append(f'<p class="warn">These rows were measured under {measured} different protocols (evaluation '
                     "text, window length or number of windows differ): compare numbers only between rows of the "
                     "same protocol (last column).</p>")
    elif len(groups) > 1:
        notes.append('<p class="warn">Same text and windows, but the machine, threads or software versions differ '
                     "between rows: speed and time columns are not comparable across protocols (last column).</p>")
    return "\n".join([*notes, f'<p class="protocol">{_protocol_text(records, groups)}</p>'])


def _commands(records: Sequence[Record]) -> str:
    commands = list(dict.fromkeys(str(r.command) for r in records if r.command))
    if not commands:
        return "<p>No command recorded.</p>"
    return "\n".join(f"<pre><code>{html.escape(c)}</code></pre>" for c in commands)


def default_title(records: Sequence[Record]) -> str:
    models = list(dict.fromkeys(str(r.model) for r in records if r.model))
    return f"{', '.join(models) or 'Model'}: quantization comparison"


def render_html(records: Sequence[Record], figures: dict[str, Path], title: str) -> str:
    """One self-contained page: inline CSS, every figure a data: URI, every record string HTML-escaped."""
    from llmeasyquant.version import __version__

    if not records:
        raise DataError(f"no records to report; {FIX}")
    groups = protocol_groups(records)
    labels = {i: f"P{n}" for n, (_, rows) in enumerate(groups, 1) for i in rows} if len(groups) > 1 else {}
    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    models = ", ".join(dict.fromkeys(str(r.model) for r in records))
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">Model {html.escape(models)}; {len(records)} rows; generated {generated} by llmeasyquant '
        f"{html.escape(__version__)}.</p>",
        "<h2>Results</h2>", _protocol_section(records, groups), _table(records, labels),
        "<h2>Figures</h2>", _figures(records, figures, groups),
        "<h2>Commands</h2>", "<p>The records were produced by:</p>", _commands(records),
        f'<p class="meta">Report generated {generated}.</p>', "</body>", "</html>", ""])


# ---- writing ----------------------------------------------------------------------------------------------------

def _default_figures_fn() -> FiguresFn:
    from llmeasyquant.report.compare_figures import write_figures  # matplotlib lives behind it: the `report` extra

    return write_figures


def _write_text(path: Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_report(records: Sequence[Record], out_dir: str | Path, force: bool = False,
                 figures_fn: FiguresFn | None = None, title: str | None = None) -> Path:
    """Write `out_dir/report.html`, the figures as PNG files and `records.json` (to regenerate the report), all
    at once: the folder appears only when complete. Returns the HTML path."""
    records = list(records)
    if not records:
        raise DataError(f"no records to report; {FIX}")
    figures_fn = figures_fn or _default_figures_fn()
    out_dir = Path(out_dir).expanduser()
    with staged_folder(out_dir, force) as tmp:
        figures = figures_fn(records, tmp)
        page = render_html(records, figures, title or default_title(records))
        write_records(tmp / "records.json", records)
        _write_text(tmp / "report.html", page)
    log.info("report of %d rows with %d figures in %s", len(records), len(figures), out_dir)
    return out_dir / "report.html"


def write_report_html(records: Sequence[Record], html_path: str | Path, force: bool = False,
                      figures_fn: FiguresFn | None = None, title: str | None = None) -> Path:
    """The report as one file (for `compare --report report.html`): figures drawn in a temporary folder and
    embedded, nothing else left behind."""
    records = list(records)
    if not records:
        raise DataError(f"no records to report; {FIX}")
    html_path = Path(html_path).expanduser()
    check_output(html_path, force)  # fail before drawing the figures, not after
    figures_fn = figures_fn or _default_figures_fn()
    with tempfile.TemporaryDirectory(prefix="llmeasyquant-report-") as scratch:
        page = render_html(records, figures_fn(records, Path(scratch)), title or default_title(records))
    return _write_text(html_path, page)
