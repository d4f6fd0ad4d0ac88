"""Executing examples/reading_results.ipynb as Jupyter would (tests/test_workflow.py runs it on the ci config's
results; tests/test_examples.py checks the notebook as stored)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "reading_results.ipynb"


def execute_notebook(results: Path, workdir: Path, timeout: int = 600):
    """Run examples/reading_results.ipynb on ``results`` in ``workdir`` (where it saves its figure), as Jupyter
    would; returns the executed notebook. A failing cell raises nbclient's CellExecutionError with its traceback."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    with mock.patch.dict(os.environ, {"MFPIPE_RESULTS": str(results)}):
        for key in ("MFPIPE_MODEL", "MFPIPE_REVISION"):
            os.environ.pop(key, None)
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    return nb


def check_executed(nb, workdir: Path) -> None:
    """What a run of the notebook must leave: every code cell ran without an error and the figure is a PNG."""
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert cells and all(c.execution_count for c in cells)
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]
    figure = workdir / "reading_results.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
