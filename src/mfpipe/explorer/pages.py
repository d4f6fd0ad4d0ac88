"""The run's pages of the explorer (issue 61 item 4), as data for the page's charts, each from the table the run's own
figure is drawn from: the rollout (centroid cosine by depth for every kernel, ``rollout/<model>/<revision>/
scores.csv``), the substitution across training (ΔL and D_MF against the step, ``substitution_<model>.csv``, with the
model's induction window), the kernel's similarity across checkpoints (``kernel_cka_adjacent_<model>.csv``), the
function vectors (``fv_<model>_<revision>.csv``) and the divergence diagnostics (``divergence_<model>_<revision>.csv``).

And the tables the head cards link to, as HTML pages with one anchor per head row (``L1H3``, or ``step0-L1H3`` in a
table of every revision), every cell escaped text."""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["records", "run_pages", "table_html", "row_anchor", "LINKED_TABLES"]

# the head-level tables a card links to: the name the explorer gives them -> the input key holding their paths
LINKED_TABLES = ("ranking_heads", "head_scores", "substitution_heads", "kernel_spread", "positional",
                 "positional_repeated", "icl_meter_heads", "fv_heads")


def records(df: pd.DataFrame) -> list[dict]:
    """Rows as JSON-ready dicts (NaN and infinities as None, numpy scalars as Python's)."""
    out = []
    for r in df.to_dict("records"):
        row = {}
        for k, v in r.items():
            if isinstance(v, (np.floating, float)):
                v = float(v) if np.isfinite(v) else None
            elif isinstance(v, np.integer):
                v = int(v)
            elif isinstance(v, np.bool_):
                v = bool(v)
            row[str(k)] = v
        out.append(row)
    return out


def _read(path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path is not None and Path(path).is_file() else None


def run_pages(files: Mapping, induction_window) -> dict:
    """The data of the run's pages: ``rollout`` / ``fv`` / ``divergence`` ``{revision: rows}``, ``substitution`` and
    ``cka`` rows, ``induction_window`` ([first, last] step or None)."""
    pages: dict = {"rollout": {}, "fv": {}, "divergence": {}, "substitution": [], "cka": [],
                   "induction_window": list(induction_window) if induction_window else None}
    for key in ("rollout", "fv", "divergence"):
        for rev, path in files.get(key, {}).items():
            df = _read(path)
            if df is not None:
                pages[key][rev] = records(df)
    for key, name in (("substitution", "substitution"), ("cka", "kernel_cka_adjacent")):
        df = _read(files.get(name))
        if df is not None:
            pages[key] = records(df)
    return pages


def row_anchor(row: Mapping, long: bool) -> str | None:
    """The anchor of a head row: ``L<layer>H<head>``, prefixed by ``<revision>-`` in a table of every revision."""
    try:
        a = f"L{int(row['layer'])}H{int(row['head'])}"
    except (KeyError, TypeError, ValueError):
        return None
    return f"{row['revision']}-{a}" if long else a


def table_html(df: pd.DataFrame, title: str, source: str, long: bool) -> str:
    """A table as a standalone page, one anchor per head row (the first row of a head where it has several);
    ``long``: a table of every revision (anchors ``<revision>-L<l>H<h>``)."""
    seen: set = set()
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = []
    for r in df.to_dict("records"):
        a = row_anchor(r, long)
        ident = f' id="{html.escape(a)}"' if a and a not in seen else ""
        if a:
            seen.add(a)
        cells = "".join(f"<td>{html.escape(_cell(v))}</td>" for v in r.values())
        body.append(f"<tr{ident}>{cells}</tr>")
    style = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
             "padding:2px 6px;font-size:13px}tr:target{background:#fd5}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) + "</title><style>"
            + style + "</style></head><body>\n<h1>" + html.escape(title) + "</h1>\n<p>From <code>"
            + html.escape(source) + "</code>.</p>\n<table><tr>" + head + "</tr>\n" + "\n".join(body)
            + "\n</table></body></html>\n")


def _cell(v) -> str:
    if isinstance(v, float):
        return "" if not np.isfinite(v) else f"{v:.6g}"
    return str(v)
