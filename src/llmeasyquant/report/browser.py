"""Open an HTML report in headless Chromium: a screenshot, and whether every image on the page decoded.

Used by the report's test and by `benchmarks/render_report.py`; Chromium is a system package (`apt-get install
chromium`), not a Python dependency, so callers decide what to do when `find_chromium()` gives None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# The background-networking flags keep Chromium from trying (and failing) to reach its own services offline.
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--disable-dev-shm-usage")
# The report itself runs no script; this copy adds one that only records, per image, whether it decoded.
_ANNOTATE = ("<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
             "Array.from(document.images).map(i => i.complete && i.naturalWidth > 0 ? '1' : '0').join('')));"
             "</script>")


def find_chromium() -> str | None:
    for candidate in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _headless(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=90, check=False)


def screenshot(browser: str, page: Path, png: Path, size: tuple[int, int] = (1200, 4000)) -> str:
    """Render `page` to `png`; returns Chromium's stderr (for error messages)."""
    with tempfile.TemporaryDirectory() as profile:
        done = _headless(browser, Path(profile), f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
                         page.resolve().as_uri())
    return done.stderr


def images_loaded(browser: str, page: Path) -> list[bool] | None:
    """For each <img> of `page` in document order, whether it decoded; None if the page did not load."""
    text = page.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as scratch:
        annotated = Path(scratch) / "annotated.html"
        annotated.write_text(text.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';")
                             .replace("</body>", f"{_ANNOTATE}</body>"), encoding="utf-8")
        done = _headless(browser, Path(scratch) / "profile", "--dump-dom", "--virtual-time-budget=10000",
                         annotated.as_uri())
    found = re.search(r'<body[^>]*data-images="([01]*)"', done.stdout)
    return None if found is None else [flag == "1" for flag in found.group(1)]
