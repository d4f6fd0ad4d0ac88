"""Atomic file output: an interrupted job must never leave a file Snakemake would take as done."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_mode(path: str | Path) -> None:
    """Give a temporary file or folder the permissions a plain open()/mkdir() would have had.

    mkstemp/mkdtemp create them private (0600 / 0700). Renamed into place as they are, results on a shared
    cluster filesystem could not be read by collaborators."""
    path = Path(path)
    mode = (0o777 if path.is_dir() else 0o666) & ~_umask()
    os.chmod(path, mode)


def _tmp_sibling(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path (same folder, same suffix) to write ``path`` through; on success it is published
    with umask permissions and renamed onto ``path`` in one step; on any error (or a kill) nothing is left
    that Snakemake or a reader could take for the output. The one way mfpipe writes a file."""
    path = Path(path)
    tmpdir = _tmp_sibling(path)
    try:
        tmp = tmpdir / path.name
        yield tmp
        publish_mode(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def atomic_savez(path: str | Path, **arrays: np.ndarray) -> None:
    with atomic_file(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)


@contextmanager
def atomic_dir(path: str | Path, entries: Sequence[str] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``path`` in one rename.

    With ``entries`` (names inside the directory) a ``path`` that already holds other files keeps them: only
    ``entries`` are replaced, one rename each, in the order given (put the file that marks completion last)."""
    path = Path(path)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        publish_mode(tmp)
        if entries is not None and path.is_dir() and any(path.iterdir()):
            for name in entries:
                src, dst = tmp / name, path / name
                if dst.is_dir() and not dst.is_symlink():
                    shutil.rmtree(dst)
                elif dst.exists() or dst.is_symlink():
                    dst.unlink()
                os.replace(src, dst)
            return
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
