"""The explorer's shared assets: plotly.js as the plotly package ships it and the explorer's own script and style
(package data, ``static/``), written once beside every model's pages."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

__all__ = ["write_assets", "plotly_bundle", "ASSETS"]

ASSETS = ("plotly.min.js", "explorer.js", "explorer.css")


def plotly_bundle() -> Path:
    """plotly.js as the plotly package ships it (one file, no network)."""
    import plotly

    p = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not p.is_file():
        raise FileNotFoundError(f"plotly's JavaScript bundle is missing ({p}): reinstall plotly (pip install plotly)")
    return p


def write_assets(folder) -> None:
    """plotly.js and the explorer's own script and style into ``folder`` (shared by every model's pages)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_bundle(), folder / "plotly.min.js")
    static = resources.files("mfpipe.explorer") / "static"
    for name in ("explorer.js", "explorer.css"):
        (folder / name).write_bytes((static / name).read_bytes())


