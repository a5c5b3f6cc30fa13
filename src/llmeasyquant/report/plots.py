"""Figures (matplotlib, the optional `report` extra). Each takes plain data, writes one PNG atomically and
labels the protocol the data came from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmeasyquant.infra.files import write_atomic


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'llmeasyquant[report]'") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: str | Path) -> Path:
    try:
        return write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    finally:
        _pyplot().close(figure)  # pyplot keeps every open figure otherwise


def plot_bits_per_layer(result: Any, path: str | Path) -> Path:
    """Bars of the bit width chosen for each layer of a `SearchResult`, coloured by layer kind."""
    plt = _pyplot()
    layers = result.layers
    kinds = sorted({layer.name.rsplit(".", 1)[-1] for layer in layers})
    colours = {kind: plt.get_cmap("tab10")(i % 10) for i, kind in enumerate(kinds)}
    figure, axes = plt.subplots(figsize=(max(8.0, len(layers) * 0.05), 3.2))
    axes.bar(range(len(layers)), [layer.bits for layer in layers], width=1.0,
             color=[colours[layer.name.rsplit(".", 1)[-1]] for layer in layers])
    for kind, colour in colours.items():
        axes.bar([0], [0], color=colour, label=kind)
    axes.set_xlabel("linear layer, in model order")
    axes.set_ylabel("bits")
    s, p = result.search, result.predicted
    axes.set_yticks(sorted({scheme.bits for scheme in s.schemes()}))
    among = (", ".join(s.candidate_schemes) if s.candidate_schemes
             else f"group {s.group_size or 'per channel'}")
    axes.set_title(f"{s.method} plan for {result.budget.label()} ({p['avg_bits']:.3f} bits/weight), sensitivity "
                   f"{s.sensitivity}, {among}", fontsize=9)
    axes.legend(fontsize=7, ncol=len(kinds), loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    return _save(figure, path)


def plot_size_quality(series: dict[str, Sequence[tuple[float, float]]], path: str | Path, protocol: str,
                      reference: float | None = None, xlabel: str = "stored MB",
                      ylabel: str = "perplexity") -> Path:
    """Size against quality, one marked line per series (e.g. uniform widths, searched plans); lower-left wins."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for (name, points), marker in zip(series.items(), "osD^v<>", strict=False):
        ordered = sorted(points)
        axes.plot([x for x, _ in ordered], [y for _, y in ordered], marker=marker, label=name)
    if reference is not None:
        axes.axhline(reference, color="grey", linestyle="--", linewidth=1, label="unquantized")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_yscale("log")
    axes.set_title(protocol, fontsize=8)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    return _save(figure, path)
