"""Atomic file output: an interrupted job must never leave a file Snakemake would take as done."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmpdir = _tmp_sibling(path)
    try:
        tmp = tmpdir / path.name
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def atomic_savez(path: str | Path, **arrays: np.ndarray) -> None:
    path = Path(path)
    tmpdir = _tmp_sibling(path)
    try:
        tmp = tmpdir / path.name
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename."""
    path = Path(path)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        publish_mode(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
