"""Small result tables (CSV + Markdown) assembled from per-model outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from .io import atomic_write_text
from .tracked import TrackedSet


def coverage_table(tracked_paths: Sequence[str | Path], models: Sequence[str]) -> pd.DataFrame:
    """App. F Table (position coverage): model, vocabulary, N, position coverage."""
    rows = []
    for model, path in zip(models, tracked_paths):
        ts = TrackedSet.load(path)
        rows.append({"model": model, "corpus": ts.meta.get("corpus"), "vocabulary": ts.vocab_size,
                     "n_tracked": ts.n, "position_coverage": round(ts.coverage, 4)})
    return pd.DataFrame(rows)


def induction_summary(induction_csvs: Sequence[str | Path]) -> pd.DataFrame:
    """Max-over-heads induction score per model and checkpoint step (and where it is)."""
    frames = [pd.read_csv(p) for p in induction_csvs]
    df = pd.concat(frames, ignore_index=True)
    idx = df.groupby(["model", "step"])["score"].idxmax()
    best = df.loc[idx, ["model", "step", "layer", "head", "score"]].rename(columns={"score": "max_score"})
    return best.sort_values(["model", "step"]).reset_index(drop=True)


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
