"""The eight figures of the comparison report, one function per figure over compare records.

The records are what `llmeasyquant compare --json` writes (schema: docs/compare_record.md). Each function writes one
small PNG atomically, colours a method the same way in every figure (`method_colours`), and carries one caption line
stating the protocol (`protocol_caption`). Optional fields may be missing: a row without the data is skipped or
marked "not measured", and a figure whose data no record holds is still written, as a panel saying so."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llmeasyquant.record import Record
from llmeasyquant.report.layer_figures import plot_error_heatmap, plot_error_violins, plot_weight_tsne
from llmeasyquant.report.style import (
    FIGSIZE,
    LATENCY_PARTS,
    REFERENCE_COLOUR,
    TITLES,
    _colour_ticklabels,
    _finish,
    _is_reference,
    _maybe_log,
    _not_measured,
    _number,
    _present,
    _pyplot,
    method_colours,
    row_labels,
)

log = logging.getLogger(__name__)

# ---- 1. weight distributions -------------------------------------------------------------------------------------

def _hist_arrays(name: str, hist: dict) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    edges = np.asarray(hist.get("edges") or [], dtype=float)
    out = []
    for key in ("float", "quantized"):
        counts = hist.get(key)
        counts = None if counts is None else np.asarray(counts, dtype=float)
        if counts is not None and counts.shape != (len(edges) - 1,):
            log.warning("weight_hist of %s: %d %s counts for %d edges; skipping the row", name, len(counts), key,
                        len(edges))
            return None
        out.append(counts)
    return (edges, out[0], out[1]) if len(edges) >= 2 else None


def plot_weight_distributions(records: list[Record], path: str | Path) -> Path:
    """Figure 1: one panel per method, the representative layer's weights before (outline) and after (filled)."""
    title = TITLES["weight_distributions"]
    rows = [(n, arrays, h.get("layer")) for n, _, h in _present(records, "weight_hist")
            if (arrays := _hist_arrays(n, h)) is not None]
    if not rows:
        return _not_measured(title, records, path, "weight_hist")
    plt, colours = _pyplot(), method_colours(records)
    ncols = {1: 1, 2: 2, 4: 2}.get(len(rows), min(len(rows), 3))
    nrows = math.ceil(len(rows) / ncols)
    figure, grid = plt.subplots(nrows, ncols, figsize=(7.0, max(4.0, 2.0 * nrows)), layout="constrained",
                                squeeze=False)
    layers = {layer for _, _, layer in rows}
    for axes, (name, (edges, before, after), layer) in zip(grid.flat, rows, strict=False):
        if after is not None:
            axes.stairs(after, edges, fill=True, color=colours[name], alpha=0.75, label="quantized")
        if before is not None:
            axes.stairs(before, edges, color="black", linewidth=0.9, label="float")
        axes.set_yscale("log")  # quantized weights pile up on a few levels: linear counts would hide the float shape
        axes.set_ylim(bottom=0.8)
        axes.set_title(name if len(layers) == 1 else f"{name}: {layer}", fontsize=9, color=colours[name])
        axes.tick_params(labelsize=7)
    for axes in grid.flat[len(rows):]:
        axes.axis("off")
    grid.flat[0].legend(fontsize=7, frameon=False)
    figure.supxlabel("weight value", fontsize=8)
    figure.supylabel("count (log)", fontsize=8)
    layer_note = f"layer {layers.pop()}" if len(layers) == 1 else "representative layer per method"
    return _finish(figure, title, records, path, f"{layer_note}; outline: float weights, filled: after quantization")


# ---- 2. quality --------------------------------------------------------------------------------------------------

def _quality_panel(axes: Any, records: list[Record], field: str, colours: dict[str, Any], label: str) -> None:
    rows = [(label, r) for label, r in zip(row_labels(records), records, strict=True) if not _is_reference(r)]
    names = [label for label, _ in rows]
    values = [_number(r.metric(field)) for _, r in rows]
    measured = [v for v in values if v is not None]
    xs = range(len(names))
    axes.bar(xs, [v or 0.0 for v in values], color=[colours[n] for n in names])
    _maybe_log(axes, measured)
    for x, value in zip(xs, values, strict=True):
        text = "not measured" if value is None else f"{value:.4g}"
        axes.annotate(text, (x, value or 0.0), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7,
                      rotation=90 if value is None else 0, va="bottom")
    axes.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    _colour_ticklabels(axes.get_xticklabels(), names, colours)
    axes.set_ylabel(label, fontsize=8)
    axes.margins(y=0.15)


def plot_quality(records: list[Record], path: str | Path) -> Path:
    """Figure 2: perplexity per method (bars; the unquantized value as a dashed line) and KL divergence."""
    title = TITLES["quality"]
    if not _present(records, "ppl") and not _present(records, "kld"):
        return _not_measured(title, records, path, "ppl, kld")
    plt, colours = _pyplot(), method_colours(records)
    figure, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE, layout="constrained")
    _quality_panel(left, records, "ppl", colours, "perplexity (lower is better)")
    for name, record, value in _present(records, "ppl"):
        if _is_reference(record) and _number(value) is not None:
            left.axhline(float(value), color=REFERENCE_COLOUR, linestyle="--", linewidth=1,
                         label=f"{name} {float(value):.4g}")
            left.legend(fontsize=7, frameon=False, loc="upper left")
    _quality_panel(right, records, "kld", colours, "KL(P_ref ‖ P_quant) per token (nats)")
    return _finish(figure, title, records, path, "perplexity and KL divergence on the same windows")


# ---- 3. latency breakdown ----------------------------------------------------------------------------------------

def plot_latency_breakdown(records: list[Record], path: str | Path) -> Path:
    """Figure 3: per method, decode latency per token split into load, quant, gemm and other (stacked, ms)."""
    title = TITLES["latency_breakdown"]
    rows = _present(records, "latency")
    if not rows:
        return _not_measured(title, records, path, "latency")
    plt, colours = _pyplot(), method_colours(records)
    extra = sorted({k for _, _, lat in rows for k in lat} - set(LATENCY_PARTS))  # e.g. comm, sync
    parts = [*LATENCY_PARTS, *extra]
    names = row_labels(records)
    latency = {name: value for name, _, value in rows}
    part_colours = plt.get_cmap("cividis")(np.linspace(0.1, 0.95, len(parts)))  # not method colours: no confusion
    figure, axes = plt.subplots(figsize=FIGSIZE, layout="constrained")
    bottom = np.zeros(len(names))
    for part, colour in zip(parts, part_colours, strict=True):
        ms = np.array([1000.0 * (_number(latency.get(n, {}).get(part)) or 0.0) for n in names])
        axes.bar(range(len(names)), ms, bottom=bottom, color=colour, label=part, edgecolor="white", linewidth=0.5)
        bottom += ms
    for x, name in enumerate(names):
        text = f"{bottom[x]:.3g}" if name in latency else "not measured"
        axes.annotate(text, (x, bottom[x]), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    _colour_ticklabels(axes.get_xticklabels(), names, colours)
    axes.set_ylabel("ms per decoded token", fontsize=8)
    axes.margins(y=0.12)
    axes.legend(fontsize=7, frameon=False, ncol=len(parts), loc="upper left")
    return _finish(figure, title, records, path, "load: weight loading/unpacking, quant: activation quantization, "
                   "gemm: matrix products, other: the rest")


# ---- 4. radar ----------------------------------------------------------------------------------------------------

def _radar_axes(records: list[Record]) -> list[tuple[str, str, str]]:
    """(axis label, metric, normalization). Accuracy reads perplexity when any row has it, else KL divergence."""
    accuracy = ("accuracy\n(ppl)", "ppl", "best/x") if _present(records, "ppl") else (
        "accuracy\n(KL)", "kld", "1-x/max")
    return [accuracy, ("speed\n(decode tok/s)", "decode_tok_s", "x/best"), ("memory\n(checkpoint)",
            "checkpoint_bytes", "best/x"), ("setup time", "quantize_s", "1-x/max"),
            ("calibration\ndata", "calib_samples", "1-x/max")]


def _normalize(values: list[float | None], rule: str) -> list[float]:
    """Scores in [0, 1], 1 = best row; a missing value scores 0. Ratios keep small gaps small; the cost axes that
    can be zero (no setup, no calibration) use the share of the largest cost saved instead of a ratio."""
    measured = [v for v in values if v is not None]
    if not measured:
        return [0.0] * len(values)
    if rule == "x/best":
        best = max(measured)
        return [0.0 if v is None else (v / best if best > 0 else 1.0) for v in values]
    if rule == "best/x":
        best = min(measured)
        return [0.0 if v is None else (best / v if v > 0 else 1.0) for v in values]
    worst = max(measured)
    return [0.0 if v is None else (1.0 - v / worst if worst > 0 else 1.0) for v in values]


def _radar_value(record: Record, metric: str) -> float | None:
    value = record.metric(metric)
    if value is None and metric == "calib_samples":  # older records kept it in the protocol only
        value = record.protocol.get(metric)
    return _number(value)


def plot_radar(records: list[Record], path: str | Path) -> Path:
    """Figure 4: accuracy, speed, memory, setup time and calibration data per method, each scored 0..1 (1 = best)."""
    title = TITLES["radar"]
    axes_spec = _radar_axes(records)
    if not records or all(_radar_value(r, m) is None for r in records for _, m, _ in axes_spec):
        return _not_measured(title, records, path, ", ".join(m for _, m, _ in axes_spec))
    plt, colours = _pyplot(), method_colours(records)
    columns = [_normalize([_radar_value(r, metric) for r in records], rule) for _, metric, rule in axes_spec]
    angles = np.linspace(0.0, 2.0 * np.pi, len(axes_spec), endpoint=False)
    figure = plt.figure(figsize=FIGSIZE, layout="constrained")
    axes = figure.add_subplot(projection="polar")
    for i, (name, record) in enumerate(zip(row_labels(records), records, strict=True)):
        scores = [column[i] for column in columns]
        missing = [label.split("\n")[0] for label, metric, _ in axes_spec if _radar_value(record, metric) is None]
        label = name + (f" (not measured: {', '.join(missing)})" if missing else "")
        closed = np.append(angles, angles[0])
        axes.plot(closed, [*scores, scores[0]], color=colours[name], linewidth=1.5, label=label)
        axes.fill(closed, [*scores, scores[0]], color=colours[name], alpha=0.08)
    axes.set_xticks(angles, [label for label, _, _ in axes_spec], fontsize=8)
    axes.tick_params(axis="x", pad=8)
    for label, angle in zip(axes.get_xticklabels(), angles, strict=True):  # grow away from the ring, not across it
        label.set_horizontalalignment("left" if np.cos(angle) > 0.1 else "right" if np.cos(angle) < -0.1 else "center")
    axes.set_ylim(0.0, 1.0)
    axes.set_yticks([0.25, 0.5, 0.75, 1.0], ["", "0.5", "", "1"], fontsize=6, color="0.4")
    axes.legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.3, 0.5))
    accuracy = "best ppl / ppl" if axes_spec[0][1] == "ppl" else "1 − KL / largest KL"
    note = (f"1 = best row on each axis; accuracy: {accuracy}; speed: tok/s / fastest; memory: smallest checkpoint "
            "/ checkpoint; setup time and calibration samples: 1 − value / largest; not measured = 0")
    return _finish(figure, title, records, path, note)


# ---- 8. context scaling ------------------------------------------------------------------------------------------

def _context_curve(name: str, value: dict) -> tuple[list[int], list[float]]:
    points = []
    for length, ppl in value.items():
        try:
            points.append((int(length), _number(ppl)))
        except ValueError:
            log.warning("context_ppl of %s: %r is not a context length; skipped", name, length)
    points = sorted((x, y) for x, y in points if y is not None and x > 0)
    return [x for x, _ in points], [y for _, y in points]


def plot_context_scaling(records: list[Record], path: str | Path) -> Path:
    """Figure 8: perplexity against context length (log2 axis) per method; the unquantized row dashed."""
    title = TITLES["context_scaling"]
    curves = [(name, record, *_context_curve(name, value)) for name, record, value in _present(records, "context_ppl")]
    curves = [c for c in curves if c[2]]
    if not curves:
        return _not_measured(title, records, path, "context_ppl")
    plt, colours = _pyplot(), method_colours(records)
    figure, axes = plt.subplots(figsize=FIGSIZE, layout="constrained")
    for name, record, xs, ys in curves:
        axes.plot(xs, ys, marker="o", markersize=4, color=colours[name], label=name,
                  linestyle="--" if _is_reference(record) else "-")
    lengths = sorted({x for _, _, xs, _ in curves for x in xs})
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [str(x) for x in lengths], fontsize=8)
    axes.minorticks_off()
    _maybe_log(axes, [y for *_, ys in curves for y in ys])
    axes.set_xlabel("context length (tokens)", fontsize=8)
    axes.set_ylabel("perplexity (lower is better)", fontsize=8)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, frameon=False)
    return _finish(figure, title, records, path, "perplexity of each window length on the same text")


# ---- all figures -------------------------------------------------------------------------------------------------

_PLOTS: dict[str, Callable[[list[Record], str | Path], Path]] = {
    "weight_distributions": plot_weight_distributions, "quality": plot_quality,
    "latency_breakdown": plot_latency_breakdown, "radar": plot_radar, "error_heatmap": plot_error_heatmap,
    "error_violins": plot_error_violins, "weight_tsne": plot_weight_tsne, "context_scaling": plot_context_scaling,
}
FIGURES: dict[str, tuple[str, Callable[[list[Record], str | Path], Path]]] = {
    stem: (title, _PLOTS[stem]) for stem, title in TITLES.items()}


def write_figures(records: list[Record], out_dir: str | Path) -> dict[str, Path]:
    """All eight figures as `<stem>.png` in `out_dir`, in report order; absent data gives a 'not measured' panel."""
    out = Path(out_dir).expanduser()
    return {stem: plot(records, out / f"{stem}.png") for stem, (_, plot) in FIGURES.items()}
