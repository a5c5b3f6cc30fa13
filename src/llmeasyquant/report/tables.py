"""Result rows as a plain-text table (the terminal) and as Markdown (docs/RESULTS.md)."""

from __future__ import annotations


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
