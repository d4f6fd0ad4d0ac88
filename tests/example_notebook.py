"""Executing the example notebooks as Jupyter would: examples/reading_results.ipynb on the ci config's results, and
examples/notebook_api.ipynb on the ci run's mini GPT-2 checkpoint (both in tests/test_workflow.py, which builds the
run once; tests/test_examples.py checks the notebooks as stored)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "reading_results.ipynb"
API_NOTEBOOK = EXAMPLES / "notebook_api.ipynb"
# what each notebook saves where it runs
FIGURES = {NOTEBOOK: "reading_results.png", API_NOTEBOOK: "notebook_api.png"}


def execute_notebook(results: Path, workdir: Path, timeout: int = 600, notebook: Path = NOTEBOOK,
                     env: dict | None = None):
    """Run ``notebook`` on ``results`` in ``workdir`` (where it saves its figure), as Jupyter would, with ``env`` added
    to the environment; returns the executed notebook. A failing cell raises nbclient's CellExecutionError with its
    traceback."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    with mock.patch.dict(os.environ, {"MFPIPE_RESULTS": str(results), **dict(env or {})}):
        for key in ("MFPIPE_MODEL", "MFPIPE_REVISION", "MFPIPE_TOKENIZER", "MFPIPE_TEXTS"):
            if key not in (env or {}):
                os.environ.pop(key, None)
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    return nb


def check_executed(nb, workdir: Path, notebook: Path = NOTEBOOK) -> None:
    """What a run of the notebook must leave: every code cell ran without an error and the figure is a PNG."""
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert cells and all(c.execution_count for c in cells)
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]
    figure = workdir / FIGURES[notebook]
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
