"""Writing an output file safely: into a temporary file beside it, renamed over it only once complete, with the
permissions a newly created file would have (mkstemp makes private files)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to fill a temporary file, then rename it to `path`; a failure leaves `path` untouched."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o666 & ~current_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
