"""The tokenizers' rank-frequency curves on the statistics half (paper App. F, ``fig:zipf``).

For one model: every type's occurrence count at positions >= 1 of the `stats` half's windows (the counts the
tracked set is selected from, :func:`mfpipe.corpus.tracked.count_types`), ranked as the tracked set ranks them
(count descending, ties by smaller id, BOS never ranked, types that never occur left out). ``frequency`` is the
count over every position >= 1 (BOS occurrences there included), the denominator of the position coverage, so
the top-N rows' frequencies sum to the tracked set's coverage. The cutoff is rank N (``tracked.n_tracked``), or
the last rank where fewer types occur.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["shard_counts", "rank_frequency", "cutoff", "zipf_summary", "zipf_figure"]


def shard_counts(shards_dir: str | Path, half: str = "stats") -> tuple[np.ndarray, int]:
    """(counts [vocab], bos id) of a corpus's tokenized ``half`` (results/corpus/<corpus>/<model>/shards)."""
    import json

    from mfpipe.corpus.tracked import count_types
    from mfpipe.corpus.windows import list_shards, read_shard

    shards_dir = Path(shards_dir)
    info = json.loads((shards_dir / "fingerprint.json").read_text())
    counts = count_types((read_shard(x).tokens for x in list_shards(shards_dir / half)), int(info["vocab_size"]))
    return counts, int(info["bos_id"])


def rank_frequency(counts: np.ndarray, bos_id: int) -> pd.DataFrame:
    """Table ``rank`` (1-based), ``type_id``, ``count``, ``frequency``: every occurring type but BOS, ranked."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    eligible = counts.copy()
    eligible[int(bos_id)] = 0
    order = np.lexsort((np.arange(len(eligible)), -eligible))
    order = order[eligible[order] > 0]
    return pd.DataFrame({"rank": np.arange(1, len(order) + 1, dtype=np.int64), "type_id": order.astype(np.int64),
                         "count": counts[order], "frequency": counts[order] / max(total, 1)})


def cutoff(table: pd.DataFrame, n: int) -> pd.Series:
    """The row of rank ``n`` (the tracked cutoff), or of the last rank when fewer types occur."""
    if table.empty:
        raise ValueError("rank-frequency table is empty: no type occurs on the statistics half")
    return table.iloc[min(int(n), len(table)) - 1]


def zipf_summary(tables: Mapping[str, pd.DataFrame], n: int) -> pd.DataFrame:
    """One row per model: types seen, the cutoff's rank, count and frequency, the top-N coverage."""
    rows = []
    for model, t in tables.items():
        c = cutoff(t, n)
        rows.append({"model": model, "types_seen": len(t), "n_tracked": int(c["rank"]),
                     "cutoff_count": int(c["count"]), "cutoff_frequency": float(c["frequency"]),
                     "top_n_coverage": float(t["frequency"].iloc[: int(c["rank"])].sum())})
    return pd.DataFrame(rows)


def zipf_figure(tables: Mapping[str, pd.DataFrame], n: int, out, png=None, title: str | None = None):
    """``fig:zipf``: one log-log rank-frequency curve per model, the rank-N cutoff dashed, each model's cutoff
    frequency marked and listed in the legend."""
    from matplotlib.ticker import FuncFormatter

    from mfpipe.workflow.plots import figure_paths, new_figure, read_table, save_figure, step_label

    fig, axes = new_figure(1, 1, w=5.2, h=3.8)
    ax = axes[0, 0]
    for model, t in tables.items():
        t = read_table(t)
        c = cutoff(t, n)
        line, = ax.loglog(t["rank"], t["frequency"], lw=1.2,
                          label=f"{model} (f@{int(c['rank'])} = {c['frequency']:.2e})")
        ax.plot([c["rank"]], [c["frequency"]], "o", ms=4, color=line.get_color())
    ax.axvline(n, ls="--", color="0.3", lw=1, label=f"cutoff N = {n}")
    ax.set_xlabel("rank")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: step_label(v)))  # ranks as numbers: 1, 10, 100
    ax.set_ylabel("frequency (statistics half)")
    ax.set_title(title or "Rank-frequency of each tokenizer")
    ax.legend(loc="lower left")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png
