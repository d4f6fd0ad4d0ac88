"""Atomic outputs: written through a temporary sibling, then published with the permissions a plain write
would have had (mkstemp/mkdtemp make them private), so shared results stay readable by collaborators."""
import os
import stat

import numpy as np
import pytest

from mfpipe.workflow.io import atomic_dir, atomic_savez, atomic_write_text
from mfpipe.stats import save_partial
from mfpipe.stats.partials import SUM_KEYS, sum_shapes


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_atomic_outputs_get_umask_permissions(tmp_path, umask_022):
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_savez(tmp_path / "b.npz", x=np.zeros(2))
    save_partial(tmp_path / "c.zarr", {k: np.zeros(v) for k, v in sum_shapes(1, 1, 2, 2, 1, 3).items() if k in SUM_KEYS})
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "inner.txt").write_text("y")
    assert mode(tmp_path / "a.txt") == 0o644
    assert mode(tmp_path / "b.npz") == 0o644
    assert mode(tmp_path / "c.zarr") == 0o755
    assert mode(tmp_path / "c.zarr" / "zarr.json") == 0o644
    assert mode(tmp_path / "d") == 0o755
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_figures_get_umask_permissions(tmp_path, umask_022):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mfpipe.experiments.rollout.figures import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_figure(fig, tmp_path / "f.pdf", tmp_path / "f.png")
    plt.close(fig)
    assert mode(tmp_path / "f.pdf") == 0o644 and mode(tmp_path / "f.png") == 0o644


def test_a_killed_writers_temporary_folder_is_removed_by_the_next_writer_a_live_ones_is_kept(tmp_path):
    """Issue 12: a SIGKILLed job leaves its temporary sibling (never taken for the output); the next write of the
    same output removes it, but not one of a process still running, nor one of another host."""
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    stale = tmp_path / f".a.txt.tmp-{host}.{int(dead.stdout)}.abc"
    live = tmp_path / f".a.txt.tmp-{host}.{os.getpid()}.def"
    other = tmp_path / f".a.txt.tmp-elsewhere.{int(dead.stdout)}.ghi"
    for d in (stale, live, other):
        d.mkdir()
        (d / "a.txt").write_text("half")
    atomic_write_text(tmp_path / "a.txt", "x")
    assert (tmp_path / "a.txt").read_text() == "x"
    assert not stale.exists() and live.is_dir() and other.is_dir()
