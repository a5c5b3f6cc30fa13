"""`llmeasyquant report RESULTS.json [MORE.json ...] --out DIR`: one self-contained HTML page (figures, results
table, protocol, commands) from the records that compare, eval or quantize wrote with --json."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmeasyquant.errors import ConfigError


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="a self-contained HTML report (figures, table, protocol) from JSON results")
    r.add_argument("results", type=Path, nargs="+",
                   help="JSON files written by compare / eval / quantize --json, or a report folder to regenerate")
    r.add_argument("--out", type=Path, required=True,
                   help="folder to write report.html, the figures (PNG) and records.json into")
    r.add_argument("--force", action="store_true", help="replace --out if it exists")
    r.add_argument("--title", help="page title (default: the model's name)")


def cmd_report(args: argparse.Namespace) -> None:
    from llmeasyquant.report.html import read_records, write_report

    records = read_records(args.results)
    try:
        html_path = write_report(records, args.out, force=args.force, title=args.title)
    except ImportError as exc:
        if "pip install" not in str(exc):  # a missing extra is the user's to fix; anything else is a bug
            raise
        raise ConfigError(str(exc)) from exc
    figures = len(list(html_path.parent.glob("*.png")))
    print(f"wrote {html_path} ({figures} figures, {len(records)} rows)")
