"""Writing the explorer: one model's site and the index over the models (the shared assets:
:mod:`mfpipe.explorer.assets`).

A page opened from ``file://`` may not ``fetch`` files beside it, so the data come as script files that register
themselves (``MFX.model({...})``, ``MFX.card({...})``): the model page loads ``data/model.js`` and, on a click, the one
card file of that head and revision (``data/cards/<revision>/L<l>H<h>.js``). Their JSON is ASCII-escaped, so no
character of the corpus can end or change the script."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from mfpipe.explorer.cards import TOP_TYPES, KernelCards, context_cards
from mfpipe.explorer.pages import LINKED_TABLES, row_anchor, run_pages, table_html
from mfpipe.explorer.scores import SCORES, fv_head_means, head_roles, model_scores

__all__ = ["build_model", "model_page", "index_page", "script"]

def script(call: str, obj) -> str:
    """``MFX.<call>(<obj as ASCII JSON>);`` (NaN refused: callers pass None)."""
    return f"MFX.{call}({json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(',', ':'))});\n"


def _grid_json(g: np.ndarray) -> list:
    return np.where(np.isfinite(g), g, None).tolist()


def _ranks(g: np.ndarray) -> np.ndarray:
    """Rank of each head by a score (1 = largest), 0 where the score is NaN."""
    flat = np.where(np.isfinite(g), g, -np.inf).ravel()
    order = np.argsort(-flat, kind="stable")
    r = np.zeros(flat.size, np.int64)
    r[order] = np.arange(1, flat.size + 1)
    return np.where(np.isfinite(g.ravel()), r, 0).reshape(g.shape)


def _linked(files: Mapping, revisions) -> dict[tuple[str, str], tuple[str, pd.DataFrame, bool]]:
    """``{(table, revision): (page name, rows, long)}`` of every head-level table the cards link to; a table of every
    revision (a ``revision`` column) appears under each of its revisions with the same page."""
    out = {}
    for name in LINKED_TABLES:
        src = files.get(name)
        if src is None:
            continue
        if isinstance(src, Mapping):
            for rev, path in src.items():
                df = fv_head_means(path) if name == "fv_heads" else pd.read_csv(path)
                out[(name, rev)] = (f"{name}_{rev}", df, False, str(path))
        else:
            df = pd.read_csv(src)
            for rev in revisions:
                out[(name, rev)] = (name, df[df["revision"] == rev], True, str(src))
            out[(name, None)] = (name, df, True, str(src))
    return out


def _first_rows(linked) -> dict:
    """``{(table, revision): {(layer, head): position of the head's first row}}``: found once per table, not filtered
    again for each of the L x H cards."""
    out = {}
    for key, (_, df, _, _) in linked.items():
        first = out[key] = {}
        if len(df):
            for i, lh in enumerate(zip(df["layer"].tolist(), df["head"].tolist())):
                first.setdefault(lh, i)
    return out


def _by_head(df: pd.DataFrame | None) -> dict:
    """A table's rows split by (layer, head), in the table's order."""
    return {} if df is None or not len(df) else {lh: g for lh, g in df.groupby(["layer", "head"], sort=False)}


def _card_rows(linked, row_at, rev, layer, head) -> list[dict]:
    rows = []
    for (name, r), (page, df, long, _) in linked.items():
        at = row_at[(name, r)].get((layer, head)) if r == rev else None
        if at is None:
            continue
        row = df.iloc[at].to_dict()
        vals = {str(k): (float(v) if isinstance(v, (float, np.floating)) and np.isfinite(v) else
                         (None if isinstance(v, (float, np.floating)) else (v.item() if hasattr(v, "item") else v)))
                for k, v in row.items() if k not in ("layer", "head", "model", "revision", "head_label")}
        rows.append({"table": name, "link": f"data/tables/{page}.html#{row_anchor(row, long)}", "values": vals})
    return rows


def _contexts(path) -> pd.DataFrame:
    """A lenses ``contexts.csv``, its text columns as written: an empty next token (the window's last position) or a
    token spelt ``null`` / ``NA`` is no missing value (pandas' default reads each as NaN, which a card showed as
    "nan"); its numbers as numbers, NaN where empty."""
    df = pd.read_csv(path)
    text = [c for c in ("left", "query", "right", "next_token") if c in df.columns]
    if text:
        df[text] = pd.read_csv(path, usecols=text, dtype=str, keep_default_na=False)[text]
    return df


def build_model(out_dir, files: Mapping, *, model: str, revisions: list[str], steps: list, rollout_revisions,
                induction_window=None, top_types: int = TOP_TYPES, progress=None) -> dict:
    """Write one model's explorer data under ``out_dir`` (``model.js``, ``cards/``, ``tables/``) from the run's files
    (:func:`mfpipe.explorer.rules.explorer_inputs`); return the model's summary for the index page."""
    out_dir = Path(out_dir)
    (out_dir / "tables").mkdir(parents=True, exist_ok=True)
    stats = dict(files.get("stats", {}))
    first = KernelCards(stats[revisions[-1]], {"model": model, "revision": revisions[-1]}, top_types)
    L, H = first.stats.n_layers, first.stats.n_heads
    scores = model_scores({**files, "model": model}, revisions, L, H)
    sources = scores.pop("_sources")
    roles = head_roles(files)
    linked = _linked(files, revisions)
    for (name, rev), (page, df, long, src) in linked.items():
        if not long or rev is None:
            (out_dir / "tables" / f"{page}.html").write_text(table_html(df, page, src, long))
    lens = {rev: _contexts(p) for rev, p in files.get("lenses", {}).items()}
    row_at, lens_by_head = _first_rows(linked), {rev: _by_head(df) for rev, df in lens.items()}
    n_cards = 0
    for rev in revisions:
        kc = first if rev == revisions[-1] else KernelCards(stats[rev], {"model": model, "revision": rev}, top_types)
        folder = out_dir / "cards" / rev
        folder.mkdir(parents=True, exist_ok=True)
        ranks = {k: _ranks(v[rev]) for k, v in scores.items() if rev in v}
        values = {k: _grid_json(scores[k][rev]) for k in ranks}  # once per revision, not per head
        for l in range(L):
            for h in range(H):
                card = {"head": f"L{l}H{h}", "layer": l, "index": h, "revision": rev,
                        "scores": {k: {"value": values[k][l][h], "rank": int(ranks[k][l, h])}
                                   for k in ranks},
                        "rows": _card_rows(linked, row_at, rev, l, h), "roles": roles.get(rev, {}).get(f"L{l}H{h}", []),
                        "kernel": kc.head(l, h), "contexts": context_cards(lens_by_head.get(rev, {}).get((l, h)), l, h),
                        "contexts_mined": rev in lens}
                (folder / f"L{l}H{h}.js").write_text(script("card", card))
                n_cards += 1
        if progress is not None:
            progress(rev)
    data = {"model": model, "n_layers": L, "n_heads": H,
            "revisions": [{"name": r, "step": s, "rollout": r in rollout_revisions, "contexts": r in lens}
                          for r, s in zip(revisions, steps)],
            "scores": [{"key": k, "label": SCORES[k][0], "description": SCORES[k][1],
                        "sources": {r: Path(p).name for r, p in sources[k].items()},
                        "values": {r: _grid_json(g) for r, g in scores[k].items()}} for k in SCORES if k in scores],
            "roles": roles, "pages": run_pages(files, induction_window),
            "tables": sorted({f"data/tables/{page}.html" for page, _, _, _ in linked.values()})}
    (out_dir / "model.js").write_text(script("model", data))
    return {"model": model, "n_layers": L, "n_heads": H, "revisions": len(revisions), "cards": n_cards}


def model_page(model: str) -> str:
    """The page shell of one model: the scripts and the containers the explorer's script fills."""
    t = html.escape(model)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>mfpipe explorer: {t}</title>
<link rel="stylesheet" href="../assets/explorer.css">
<script src="../assets/plotly.min.js"></script>
<script src="../assets/explorer.js"></script>
</head><body>
<header><a href="../index.html">all models</a> <h1>Mean-field explorer: <span id="model-name">{t}</span></h1></header>
<nav id="tabs"></nav>
<main id="main"><p id="status">Loading…</p></main>
<script src="data/model.js"></script>
</body></html>
"""


def index_page(summaries: list[dict]) -> str:
    """The index over the models (each summary from :func:`build_model`, read back from its ``summary.json``)."""
    rows = "\n".join(
        f'<li><a href="{html.escape(s["model"])}/index.html">{html.escape(s["model"])}</a>: {s["n_layers"]} layers × '
        f'{s["n_heads"]} heads, {s["revisions"]} revision(s)</li>' for s in summaries)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>mfpipe explorer</title>
<link rel="stylesheet" href="assets/explorer.css"></head><body>
<header><h1>Mean-field explorer</h1></header>
<p>One page per model: the head grid (coloured by a score, with the training axis), a card per head, the run's pages.</p>
<ul id="models">
{rows}
</ul>
</body></html>
"""
