"""Figures 5 to 7 of the comparison report: block output errors as a heatmap and as violins, and a t-SNE map of
per-layer weight summaries (records: docs/compare_record.md)."""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np

from llmeasyquant.record import Record
from llmeasyquant.report.style import (
    FIGSIZE,
    TITLES,
    WIDE_RANGE,
    _colour_ticklabels,
    _finish,
    _not_measured,
    _number,
    _present,
    _pyplot,
    method_colours,
)
from llmeasyquant.report.tsne import tsne

log = logging.getLogger(__name__)


# ---- 5 and 6. per-layer errors -----------------------------------------------------------------------------------

def _layer_key(name: str) -> tuple[int, int, str]:
    """Model order: layers inside numbered blocks by block then name; anything else (e.g. lm_head) after them."""
    match = re.search(r"\.(\d+)(?:\.|$)", name)
    return (0, int(match.group(1)), name) if match else (1, 0, name)


def _error_rows(records: list[Record]) -> list[tuple[str, dict[str, float]]]:
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


def plot_error_heatmap(records: list[Record], path: str | Path) -> Path:
    """Figure 5: relative output error of every block (columns, model order) for each method (rows)."""
    title = TITLES["error_heatmap"]
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
    bar.set_label("relative output error ‖H_q − H‖ / ‖H‖" + (" (log)" if norm else ""), fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return _finish(figure, title, records, path, "grey: layer not quantized by that method")


def plot_error_violins(records: list[Record], path: str | Path) -> Path:
    """Figure 6: the distribution of per-block relative output errors of each method (violins, blocks as dots)."""
    title = TITLES["error_violins"]
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
    label = "relative output error ‖H_q − H‖ / ‖H‖"
    axes.set_ylabel(f"log10 {label}" if use_log else label, fontsize=8)
    axes.grid(axis="y", alpha=0.3)
    return _finish(figure, title, records, path, "one dot per block; bar: median")


# ---- 7. t-SNE of weight summaries --------------------------------------------------------------------------------

def _summary_points(records: list[Record]) -> tuple[list[str], np.ndarray]:
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


def plot_weight_tsne(records: list[Record], path: str | Path) -> Path:
    """Figure 7: t-SNE map of the per-layer weight summaries, one point per (method, layer), coloured by method."""
    title = TITLES["weight_tsne"]
    names, features = _summary_points(records)
    if not names:
        return _not_measured(title, records, path, "weight_summaries")
    plt, colours = _pyplot(), method_colours(records)
    seed = int(records[0].protocol.get("seed") or 0)
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
