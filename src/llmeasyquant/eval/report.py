"""Result records (one JSON shape for eval, bench, quantize and compare) and the terminal table."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

from llmeasyquant.fileio import write_atomic

# The command line being run, set by the CLI so that records name it even when main() is called in-process.
COMMAND: str | None = None


def versions() -> dict[str, str]:
    import transformers

    from llmeasyquant import __version__

    return {"llmeasyquant": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads()}


def record(kind: str, model: str, metrics: dict, protocol: dict, command: str | None = None) -> dict:
    """One result: what was measured, how, with what software, on which machine."""
    if command is None:
        command = COMMAND or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return {"kind": kind, "model": model, "metrics": metrics, "protocol": protocol, "command": command,
            "versions": versions(), "machine": machine()}


def write_json(path: str | Path, records: list[dict] | dict) -> Path:
    """Write records atomically (temporary file, then rename)."""
    return write_atomic(path, lambda tmp: tmp.write_text(json.dumps(records, indent=2)))


def _cell(value: object, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return format(value, fmt) if isinstance(value, int | float) else str(value)


COMPARE_COLUMNS = (  # (header, metric, format)
    ("scheme", "scheme", ""), ("bits/w", "bits_per_weight", ".3f"), ("ckpt MB", "checkpoint_mb", ".1f"),
    ("wt/fp32 %", "weight_bytes_pct", ".1f"),
    ("ppl", "ppl", ".3f"), ("Δppl %", "ppl_delta_pct", "+.2f"), ("KL", "kld", ".5f"), ("top-1 %", "top1_pct", ".2f"),
    ("quant s", "quantize_s", ".1f"),
)


def format_table(rows: list[dict], columns: tuple = COMPARE_COLUMNS) -> str:
    """A plain-text table; each row is a dict of metric name -> value."""
    cells = [[h for h, _, _ in columns]] + [[_cell(r.get(k), f) for _, k, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns: tuple = COMPARE_COLUMNS) -> str:
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(k), f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])
