"""Open a compare report in headless Chromium: screenshot it and check that every figure decoded.

    python benchmarks/render_report.py report.html [--png docs/figures/report_page.png] \
        [--out benchmarks/results/report_render.json]

Needs Debian's Chromium (`apt-get install chromium`); exits 2 with that message without it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from llmeasyquant.record import Record, write_records
from llmeasyquant.report.browser import find_chromium, images_loaded, screenshot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("report", type=Path)
    parser.add_argument("--png", type=Path, help="where to write the screenshot (default: beside the report)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/report_render.json"))
    args = parser.parse_args()
    browser = find_chromium()
    if browser is None:
        print("no Chromium to render the report with: apt-get install chromium", file=sys.stderr)
        return 2
    png = args.png or args.report.with_suffix(".png")
    stderr = screenshot(browser, args.report, png)
    loaded = images_loaded(browser, args.report)
    text = args.report.read_text(encoding="utf-8")
    figures = re.findall(r"<figcaption>(.*?)</figcaption>", text, flags=re.S)
    external = re.findall(r"""(?:src|href)=["'](?:https?:)?//""", text)
    metrics = {"images": len(loaded or []), "images_loaded": sum(loaded or []), "figcaptions": len(figures),
               "external_urls": len(external), "screenshot": str(png), "screenshot_bytes": png.stat().st_size
               if png.is_file() else 0, "report_bytes": args.report.stat().st_size}
    print("\n".join(f"{key}: {value}" for key, value in metrics.items()))
    write_records(args.out, Record.new("report_render", "-", metrics, {"browser": browser, "report": str(args.report)}))
    ok = loaded is not None and all(loaded) and not external and metrics["screenshot_bytes"] > 0
    if not ok:
        print(stderr[-2000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
