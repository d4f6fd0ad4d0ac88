"""Atomic file output: an interrupted job must never leave a file Snakemake would take as done."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _tmp_sibling(path: Path) -> Path:
    """A fresh temporary folder next to ``path``, named after it, this host and this process.

    A writer killed before publishing (SIGKILL, node failure) leaves its temporary folder behind: never taken
    for the output (a hidden name Snakemake does not know), but possibly gigabytes. The next writer of the same
    output removes those whose process is gone -- only this host's, as a PID means nothing on another node of a
    shared filesystem, and never a live one (Snakemake's lock keeps two runs from writing one output at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    stem = f".{path.name}.tmp-"
    for old in path.parent.glob(f"{stem}*"):
        owner, _, _ = old.name[len(stem):].rpartition(".")  # "<host>.<pid>.<random>" -> "<host>.<pid>", ...
        old_host, _, pid = owner.rpartition(".")
        if old_host == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{stem}{host}.{os.getpid()}.", dir=path.parent))


STALL_ENV, STALL_MARK_ENV = "MFPIPE_STALL_BEFORE_PUBLISH", "MFPIPE_STALL_MARK"


def _stall_point(path: Path) -> None:
    """Fault-injection seam for the kill-and-resume tests (tests/test_workflow.py): when ``MFPIPE_STALL_BEFORE_PUBLISH``
    is a substring of ``path``, the writer, its output complete in the temporary folder but not yet renamed into
    place -- the moment a kill is most likely to leave something half-done -- creates the file named by
    ``MFPIPE_STALL_MARK`` and waits to be killed. Unset (always, outside those tests) it costs one lookup."""
    pattern = os.environ.get(STALL_ENV)
    if not pattern or pattern not in str(path):
        return
    mark = os.environ.get(STALL_MARK_ENV)
    if mark:
        Path(mark).write_text(str(path))
    while True:
        time.sleep(60)


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
        _stall_point(path)
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
        _stall_point(path)
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
