"""Figures and atomic file writes: PNGs from plain data, the usual permissions, nothing left behind on failure."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmeasyquant.infra.files import current_umask, write_atomic
from llmeasyquant.report.plots import plot_size_quality

pytest.importorskip("matplotlib")


def test_size_quality_plot_is_a_png(tmp_path: Path) -> None:
    series = {"uniform": [(60.0, 80.0), (70.0, 40.0), (90.0, 35.5)], "searched": [(65.0, 45.0), (75.0, 36.0)]}
    path = plot_size_quality(series, tmp_path / "figs" / "pareto.png", "synthetic protocol", reference=35.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~current_umask()
    assert [p.name for p in path.parent.iterdir()] == ["pareto.png"]


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, broken)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
