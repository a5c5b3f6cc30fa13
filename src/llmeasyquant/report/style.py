"""Conventions every comparison figure shares: rows and their labels, one colour per method, the protocol
caption, the 'not measured' panel, log scales for wide ranges, and the figure titles."""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

from llmeasyquant.models.load import BUNDLED_FILE, BUNDLED_NAMES
from llmeasyquant.record import PROTOCOL_KEYS, Record
from llmeasyquant.report.plots import _pyplot, _save
from llmeasyquant.texts import EVALUATION_SHA256

log = logging.getLogger(__name__)

FIGSIZE = (7.0, 4.0)
REFERENCE_COLOUR = "0.35"  # the unquantized row: grey, so the methods keep the bright colours
# The caption notes rows that differ in what they were measured on, or in threads: the figures show speed too.
CAPTION_KEYS = (*PROTOCOL_KEYS, "threads")
LATENCY_PARTS = ("load", "quant", "gemm", "other")
WIDE_RANGE = 20.0  # max/min above this: a log scale, so that small values stay readable


# ---- rows, colours, captions -------------------------------------------------------------------------------------

def row_labels(records: list[Record]) -> list[str]:
    """One distinct label per row: the method (bench: the model), with its scheme where a method appears twice."""
    methods = [str(r.metric("method") or r.metric("model") or f"row {i + 1}") for i, r in enumerate(records)]
    counts = Counter(methods)
    labels = [f"{m} {r.metric('scheme', '')}".strip() if counts[m] > 1 else m
              for m, r in zip(methods, records, strict=True)]
    seen = Counter(labels)
    return [f"{label} #{i + 1}" if seen[label] > 1 else label for i, label in enumerate(labels)]


def _is_reference(record: Record) -> bool:
    return record.metric("method") == "fp32" or record.metric("scheme") == "fp32"


def method_colours(records: list[Record]) -> dict[str, Any]:
    """Row label -> colour, in record order, so that every figure of one report agrees; the unquantized row grey."""
    cmap = _pyplot().get_cmap("tab10")
    methods = [label for label, r in zip(row_labels(records), records, strict=True) if not _is_reference(r)]
    return {label: REFERENCE_COLOUR if _is_reference(r) else cmap(methods.index(label) % 10)
            for label, r in zip(row_labels(records), records, strict=True)}


def _present(records: list[Record], field: str) -> list[tuple[str, Record, Any]]:
    """(label, record, value) for the rows whose metric `field` holds data (None, {} and [] count as absent)."""
    rows = []
    for label, record in zip(row_labels(records), records, strict=True):
        value = record.metric(field)
        if value is not None and value != {} and value != []:
            rows.append((label, record, value))
    return rows


def _number(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _model_label(model: str) -> str:
    return BUNDLED_FILE.split(".")[0] if model in BUNDLED_NAMES else model


def _text_label(protocol: dict) -> str:
    source = str(protocol.get("text_source") or "text not recorded")
    known = EVALUATION_SHA256.get(protocol.get("text_sha256", ""))
    return f"{known} ({source})" if known and not source.startswith(known) else source


def protocol_caption(records: list[Record]) -> str:
    """One line: model · text · windows × tokens · threads · machine, from the first record; notes any row whose
    protocol differs, because then the rows are not measured alike."""
    if not records:
        return "no records: protocol not recorded"
    first = records[0]
    protocol, machine = first.protocol, first.machine
    windows = protocol.get("windows", protocol.get("max_windows"))
    parts = [_model_label(first.model or "model not recorded"), _text_label(protocol)]
    if windows is not None or protocol.get("seqlen") is not None:
        parts.append(f"{windows if windows is not None else '?'} windows × {protocol.get('seqlen', '?')} tokens")
    threads = protocol.get("threads", machine.get("threads"))
    if threads is not None:
        parts.append(f"{threads} threads")
    processor = machine.get("cpu") or machine.get("processor")  # the CPU model where the record names it
    if processor or machine.get("cpus"):
        parts.append(", ".join(str(x) for x in (processor, machine.get("cpus") and f"{machine['cpus']} CPUs") if x))
    differ = [k for k in CAPTION_KEYS if any(r.protocol.get(k) != protocol.get(k) for r in records)]
    if differ:
        parts.append(f"rows differ in {', '.join(differ)}")
    return " · ".join(parts)


def _finish(figure: Any, title: str, records: list[Record], path: str | Path, note: str = "") -> Path:
    """Title on top, the protocol (and what the figure's axes mean) in small grey print below, then save."""
    figure.suptitle(title, fontsize=11)
    caption = protocol_caption(records) + (f"\n{note}" if note else "")
    figure.text(0.5, -0.01, caption, ha="center", va="top", fontsize=7, color="0.3", wrap=True)
    try:
        return _save(figure, path)
    finally:
        _pyplot().close(figure)  # _save clears it, but pyplot keeps every figure it made until closed


def _not_measured(title: str, records: list[Record], path: str | Path, field: str) -> Path:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=FIGSIZE, layout="constrained")
    axes.axis("off")
    axes.text(0.5, 0.5, f"not measured in these records: {field}", ha="center", va="center", fontsize=12,
              color="0.35", transform=axes.transAxes)
    log.info("%s: no record holds %s; writing a 'not measured' panel", Path(path).name, field)
    return _finish(figure, title, records, path)


def _maybe_log(axes: Any, values: list[float], axis: str = "y") -> bool:
    positive = [v for v in values if v > 0]
    wide = bool(positive) and len(positive) == len(values) and max(positive) / min(positive) > WIDE_RANGE
    if wide:
        (axes.set_yscale if axis == "y" else axes.set_xscale)("log")
    return wide


def _colour_ticklabels(labels: list[Any], names: list[str], colours: dict[str, Any]) -> None:
    for label, name in zip(labels, names, strict=False):
        label.set_color(colours.get(name, "black"))

# Figure titles by file stem, in report order (compare_figures.FIGURES pairs them with their functions).
TITLES = {
    "weight_distributions": "Weights before and after quantization",
    "quality": "Quality: perplexity and KL divergence",
    "latency_breakdown": "Where decode time goes",
    "radar": "Trade-offs at a glance",
    "error_heatmap": "Relative output error per block",
    "error_violins": "Distribution of per-block output errors",
    "weight_tsne": "t-SNE of quantized weight summaries",
    "context_scaling": "Perplexity against context length",
}
