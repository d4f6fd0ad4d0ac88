"""Atomic outputs: written through a temporary sibling, then published with the permissions a plain write
would have had (mkstemp/mkdtemp make them private), so shared results stay readable by collaborators."""
import os
import stat

import numpy as np
import pytest

from mfpipe.io import atomic_dir, atomic_savez, atomic_write_text
from mfpipe.stats import save_partial


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
    save_partial(tmp_path / "c.npz", {"x": np.zeros(2)})
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "inner.txt").write_text("y")
    assert mode(tmp_path / "a.txt") == 0o644
    assert mode(tmp_path / "b.npz") == 0o644
    assert mode(tmp_path / "c.npz") == 0o644
    assert mode(tmp_path / "d") == 0o755
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_figures_get_umask_permissions(tmp_path, umask_022):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mfpipe.figures import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_figure(fig, tmp_path / "f.pdf", tmp_path / "f.png")
    plt.close(fig)
    assert mode(tmp_path / "f.pdf") == 0o644 and mode(tmp_path / "f.png") == 0o644
