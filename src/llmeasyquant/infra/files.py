"""Writing outputs safely: into a temporary file or folder beside the target, renamed over it only once complete,
with the permissions a newly created file would have (mkstemp and mkdtemp make private ones)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from llmeasyquant.errors import OutputExistsError


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


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise OutputExistsError(f"{out} exists already; choose another path or pass --force to replace it")


def _usual_permissions(folder: Path) -> None:
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an old `out` is removed only after the new one is in place."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


@contextlib.contextmanager
def staged_folder(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out` to write into; it becomes `out` only when the block completes.

    An existing `out` is refused without `force`; on any failure the temporary folder is removed."""
    out = Path(out).expanduser()
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _usual_permissions(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
