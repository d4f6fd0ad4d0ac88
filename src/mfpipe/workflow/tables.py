"""Result tables of every experiment: the CSV / Markdown writers (atomic, so an interrupted job leaves no file
Snakemake would take as done) and a dependency-free Markdown renderer. Experiment-specific tables live in each
experiment's own ``tables`` module."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from mfpipe.workflow.io import atomic_write_text


def write_csv(df: pd.DataFrame, path: str | Path) -> None:
    atomic_write_text(path, df.to_csv(index=False))


def write_text(text: str, path: str | Path) -> None:
    atomic_write_text(path, text)



def write_table(df: pd.DataFrame, csv: str | Path | None = None, md: str | Path | None = None) -> None:
    if csv:
        atomic_write_text(csv, df.to_csv(index=False))
    if md:
        atomic_write_text(md, to_markdown(df))


def to_markdown(df: pd.DataFrame, floatfmt: str = "{:.3f}") -> str:
    """A GitHub Markdown table without the optional `tabulate` dependency."""
    cols = [str(c) for c in df.columns]
    fmt = lambda v: floatfmt.format(v) if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"
