"""The eight figures of the comparison report, one function per figure over compare records.

The records are what `llmeasyquant compare --json` writes (schema: docs/compare_record.md). Each function writes one
small PNG atomically, colours a method the same way in every figure (`method_colours`), and carries one caption line
stating the protocol (`protocol_caption`). Optional fields may be missing: a row without the data is skipped or
marked "not measured", and a figure whose data no record holds is still written, as a panel saying so."""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llmeasyquant.calibration.data import EVALUATION_SPLITS
from llmeasyquant.eval.plots import _pyplot, _save
from llmeasyquant.eval.tsne import tsne
from llmeasyquant.models.load import BUNDLED_FILE, BUNDLED_NAMES

log = logging.getLogger(__name__)

FIGSIZE = (7.0, 4.0)
REFERENCE_COLOUR = "0.35"  # the unquantized row: grey, so the methods keep the bright colours
PROTOCOL_KEYS = ("text_sha256", "seqlen", "windows", "bos", "threads")  # rows must agree on these to be compared
LATENCY_PARTS = ("load", "quant", "gemm", "other")
WIDE_RANGE = 20.0  # max/min above this: a log scale, so that small values stay readable


# ---- rows, colours, captions -------------------------------------------------------------------------------------

def _metrics(record: dict) -> dict:
    return record.get("metrics") or {}


def row_labels(records: list[dict]) -> list[str]:
    """One distinct label per row: the method, with its scheme where a method appears twice (rtn at 8 and 4 bits)."""
    methods = [str(_metrics(r).get("method") or f"row {i + 1}") for i, r in enumerate(records)]
    counts = Counter(methods)
    labels = [f"{m} {_metrics(r).get('scheme', '')}".strip() if counts[m] > 1 else m
              for m, r in zip(methods, records, strict=True)]
    seen = Counter(labels)
    return [f"{label} #{i + 1}" if seen[label] > 1 else label for i, label in enumerate(labels)]


def _is_reference(record: dict) -> bool:
    m = _metrics(record)
    return m.get("method") == "fp32" or m.get("scheme") == "fp32"


def method_colours(records: list[dict]) -> dict[str, Any]:
    """Row label -> colour, in record order, so that every figure of one report agrees; the unquantized row grey."""
    cmap = _pyplot().get_cmap("tab10")
    methods = [label for label, r in zip(row_labels(records), records, strict=True) if not _is_reference(r)]
    return {label: REFERENCE_COLOUR if _is_reference(r) else cmap(methods.index(label) % 10)
            for label, r in zip(row_labels(records), records, strict=True)}


def _present(records: list[dict], field: str) -> list[tuple[str, dict, Any]]:
    """(label, record, value) for the rows whose metric `field` holds data (None, {} and [] count as absent)."""
    rows = []
    for label, record in zip(row_labels(records), records, strict=True):
        value = _metrics(record).get(field)
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
    known = EVALUATION_SPLITS.get(protocol.get("text_sha256", ""))
    return f"{known} ({source})" if known else source


def protocol_caption(records: list[dict]) -> str:
    """One line: model · text · windows × tokens · threads · machine, from the first record; notes any row whose
    protocol differs, because then the rows are not measured alike."""
    if not records:
        return "no records: protocol not recorded"
    first = records[0]
    protocol, machine = first.get("protocol") or {}, first.get("machine") or {}
    windows = protocol.get("windows", protocol.get("max_windows"))
    parts = [_model_label(str(first.get("model") or "model not recorded")), _text_label(protocol)]
    if windows is not None or protocol.get("seqlen") is not None:
        parts.append(f"{windows if windows is not None else '?'} windows × {protocol.get('seqlen', '?')} tokens")
    threads = protocol.get("threads", machine.get("threads"))
    if threads is not None:
        parts.append(f"{threads} threads")
    if machine.get("processor") or machine.get("cpus"):
        parts.append(", ".join(str(x) for x in (machine.get("processor"), machine.get("cpus") and
                                                 f"{machine['cpus']} CPUs") if x))
    differ = [k for k in PROTOCOL_KEYS if any((r.get("protocol") or {}).get(k) != protocol.get(k) for r in records)]
    if differ:
        parts.append(f"rows differ in {', '.join(differ)}")
    return " · ".join(parts)


def _finish(figure: Any, title: str, records: list[dict], path: str | Path, note: str = "") -> Path:
    """Title on top, the protocol (and what the figure's axes mean) in small grey print below, then save."""
    figure.suptitle(title, fontsize=11)
    caption = protocol_caption(records) + (f"\n{note}" if note else "")
    figure.text(0.5, -0.01, caption, ha="center", va="top", fontsize=7, color="0.3", wrap=True)
    try:
        return _save(figure, path)
    finally:
        _pyplot().close(figure)  # _save clears it, but pyplot keeps every figure it made until closed


def _not_measured(title: str, records: list[dict], path: str | Path, field: str) -> Path:
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


def plot_weight_distributions(records: list[dict], path: str | Path) -> Path:
    """Figure 1: one panel per method, the representative layer's weights before (outline) and after (filled)."""
    title = FIGURES["weight_distributions"][0]
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

def _quality_panel(axes: Any, records: list[dict], field: str, colours: dict[str, Any], label: str) -> None:
    rows = [(label, r) for label, r in zip(row_labels(records), records, strict=True) if not _is_reference(r)]
    names = [label for label, _ in rows]
    values = [_number(_metrics(r).get(field)) for _, r in rows]
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


def plot_quality(records: list[dict], path: str | Path) -> Path:
    """Figure 2: perplexity per method (bars; the unquantized value as a dashed line) and KL divergence."""
    title = FIGURES["quality"][0]
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

def plot_latency_breakdown(records: list[dict], path: str | Path) -> Path:
    """Figure 3: per method, decode latency per token split into load, quant, gemm and other (stacked, ms)."""
    title = FIGURES["latency_breakdown"][0]
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

def _radar_axes(records: list[dict]) -> list[tuple[str, str, str]]:
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


def _radar_value(record: dict, metric: str) -> float | None:
    value = _metrics(record).get(metric)
    if value is None and metric == "calib_samples":  # older records kept it in the protocol only
        value = (record.get("protocol") or {}).get(metric)
    return _number(value)


def plot_radar(records: list[dict], path: str | Path) -> Path:
    """Figure 4: accuracy, speed, memory, setup time and calibration data per method, each scored 0..1 (1 = best)."""
    title = FIGURES["radar"][0]
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


# ---- 5 and 6. per-layer errors -----------------------------------------------------------------------------------

def _layer_key(name: str) -> tuple[int, int, str]:
    """Model order: layers inside numbered blocks by block then name; anything else (e.g. lm_head) after them."""
    match = re.search(r"\.(\d+)(?:\.|$)", name)
    return (0, int(match.group(1)), name) if match else (1, 0, name)


def _error_rows(records: list[dict]) -> list[tuple[str, dict[str, float]]]:
    rows = []
    for name, _, errors in _present(records, "layer_errors"):
        clean = {str(k): v for k, raw in errors.items() if (v := _number(raw)) is not None}
        if clean:
            rows.append((name, clean))
    return rows


def _block_ticks(layers: list[str], target: int = 12) -> tuple[list[float], list[str], list[float]]:
    """Tick positions and labels grouping the columns by block (every k-th block labelled), and block boundaries."""
    keys = [_layer_key(layer) for layer in layers]
    starts = [i for i, k in enumerate(keys) if i == 0 or k[:2] != keys[i - 1][:2]]
    step = max(1, math.ceil(len(starts) / target))
    ticks, labels = [], []
    for n, start in enumerate(starts):
        if n % step == 0:
            end = starts[n + 1] if n + 1 < len(starts) else len(layers)
            ticks.append((start + end - 1) / 2.0)
            kind, block, name = keys[start]
            labels.append(str(block) if kind == 0 else name.rsplit(".", 1)[-1])
    return ticks, labels, [s - 0.5 for s in starts[1:]]


def plot_error_heatmap(records: list[dict], path: str | Path) -> Path:
    """Figure 5: relative weight error of every quantized layer (columns, model order) for each method (rows)."""
    title = FIGURES["error_heatmap"][0]
    rows = _error_rows(records)
    if not rows:
        return _not_measured(title, records, path, "layer_errors")
    plt, colours = _pyplot(), method_colours(records)
    from matplotlib.colors import LogNorm  # matplotlib is there: _pyplot() succeeded

    layers = sorted({layer for _, errors in rows for layer in errors}, key=_layer_key)
    grid = np.array([[errors.get(layer, np.nan) for layer in layers] for _, errors in rows])  # [methods, layers]
    finite = grid[np.isfinite(grid)]
    wide = bool((finite > 0).all() and finite.max() / finite.min() > WIDE_RANGE)
    norm = LogNorm(finite.min(), finite.max()) if wide else None
    cmap = plt.get_cmap("magma_r").with_extremes(bad="0.9")  # grey: a layer a method did not quantize
    figure, axes = plt.subplots(figsize=FIGSIZE, layout="constrained")
    image = axes.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    names = [name for name, _ in rows]
    axes.set_yticks(range(len(names)), names, fontsize=8)
    _colour_ticklabels(axes.get_yticklabels(), names, colours)
    ticks, labels, boundaries = _block_ticks(layers)
    axes.set_xticks(ticks, labels, fontsize=7)
    for x in boundaries:
        axes.axvline(x, color="white", linewidth=0.4)
    axes.set_xlabel(f"block (each holds its linear layers in name order; {len(layers)} layers)", fontsize=8)
    bar = figure.colorbar(image, ax=axes, shrink=0.9)
    bar.set_label("relative error ‖W − Ŵ‖ / ‖W‖" + (" (log)" if norm else ""), fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return _finish(figure, title, records, path, "grey: layer not quantized by that method")


def plot_error_violins(records: list[dict], path: str | Path) -> Path:
    """Figure 6: the distribution of per-layer relative weight errors of each method (violins, layers as dots)."""
    title = FIGURES["error_violins"][0]
    rows = _error_rows(records)
    if not rows:
        return _not_measured(title, records, path, "layer_errors")
    plt, colours = _pyplot(), method_colours(records)
    values = [np.array(list(errors.values())) for _, errors in rows]
    everything = np.concatenate(values)
    use_log = bool((everything > 0).all() and everything.max() / everything.min() > WIDE_RANGE)
    if use_log:  # violins of the logarithm: a linear density would squash the small errors into a line
        values = [np.log10(v) for v in values]
    figure, axes = plt.subplots(figsize=FIGSIZE, layout="constrained")
    rng = np.random.default_rng(0)  # fixed jitter: the same records give the same picture
    for x, ((name, _), v) in enumerate(zip(rows, values, strict=True)):
        if len(v) >= 2 and np.ptp(v) > 0:  # a density needs spread
            parts = axes.violinplot([v], positions=[x], widths=0.8, showmedians=True, showextrema=False)
            for body in parts["bodies"]:
                body.set(facecolor=colours[name], edgecolor=colours[name], alpha=0.35)
            parts["cmedians"].set(color=colours[name], linewidth=1.5)
        axes.scatter(x + rng.uniform(-0.12, 0.12, len(v)), v, s=5, color=colours[name], alpha=0.7, linewidths=0)
    names = [name for name, _ in rows]
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    _colour_ticklabels(axes.get_xticklabels(), names, colours)
    axes.set_ylabel("log10 relative error ‖W − Ŵ‖ / ‖W‖" if use_log else "relative error ‖W − Ŵ‖ / ‖W‖", fontsize=8)
    axes.grid(axis="y", alpha=0.3)
    return _finish(figure, title, records, path, "one dot per quantized layer; bar: median")


# ---- 7. t-SNE of weight summaries --------------------------------------------------------------------------------

def _summary_points(records: list[dict]) -> tuple[list[str], np.ndarray]:
    """(method per point, features [points, f]); vectors of an odd length or with NaN are left out, with a warning."""
    rows = [(name, layer, vector) for name, _, summaries in _present(records, "weight_summaries")
            for layer, vector in summaries.items()]
    if not rows:
        return [], np.zeros((0, 0))
    length = Counter(len(vector) for _, _, vector in rows).most_common(1)[0][0]
    kept = [(name, np.asarray(vector, dtype=float)) for name, _, vector in rows if len(vector) == length]
    kept = [(name, v) for name, v in kept if np.all(np.isfinite(v))]
    if len(kept) < len(rows):
        log.warning("t-SNE: left out %d of %d weight summaries (length other than %d, or NaN/inf)",
                    len(rows) - len(kept), len(rows), length)
    return [name for name, _ in kept], np.array([v for _, v in kept]).reshape(len(kept), length)


def plot_weight_tsne(records: list[dict], path: str | Path) -> Path:
    """Figure 7: t-SNE map of the per-layer weight summaries, one point per (method, layer), coloured by method."""
    title = FIGURES["weight_tsne"][0]
    names, features = _summary_points(records)
    if not names:
        return _not_measured(title, records, path, "weight_summaries")
    plt, colours = _pyplot(), method_colours(records)
    seed = int((records[0].get("protocol") or {}).get("seed") or 0)
    perplexity = float(min(30.0, max((len(names) - 1) / 3.0, 1.0)))
    embedding = tsne(features, perplexity=perplexity, seed=seed)  # standardizes the features first
    figure, axes = plt.subplots(figsize=FIGSIZE, layout="constrained")
    for name in dict.fromkeys(names):  # record order, once each
        mask = np.array([n == name for n in names])
        axes.scatter(embedding[mask, 0], embedding[mask, 1], s=14, color=colours[name], alpha=0.8, label=name,
                     linewidths=0)
    axes.set_xticks([])
    axes.set_yticks([])
    axes.legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5), markerscale=1.5)
    note = (f"standardized per-layer summaries of the quantized weights, {len(names)} points, t-SNE perplexity "
            f"{perplexity:.0f}, seed {seed}; near = alike, axes have no units")
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


def plot_context_scaling(records: list[dict], path: str | Path) -> Path:
    """Figure 8: perplexity against context length (log2 axis) per method; the unquantized row dashed."""
    title = FIGURES["context_scaling"][0]
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

FIGURES: dict[str, tuple[str, Callable[[list[dict], str | Path], Path]]] = {
    "weight_distributions": ("Weights before and after quantization", plot_weight_distributions),
    "quality": ("Quality: perplexity and KL divergence", plot_quality),
    "latency_breakdown": ("Where decode time goes", plot_latency_breakdown),
    "radar": ("Trade-offs at a glance", plot_radar),
    "error_heatmap": ("Relative weight error per layer", plot_error_heatmap),
    "error_violins": ("Distribution of per-layer weight errors", plot_error_violins),
    "weight_tsne": ("t-SNE of quantized weight summaries", plot_weight_tsne),
    "context_scaling": ("Perplexity against context length", plot_context_scaling),
}


def write_figures(records: list[dict], out_dir: str | Path) -> dict[str, Path]:
    """All eight figures as `<stem>.png` in `out_dir`, in report order; absent data gives a 'not measured' panel."""
    out = Path(out_dir).expanduser()
    return {stem: plot(records, out / f"{stem}.png") for stem, (_, plot) in FIGURES.items()}
