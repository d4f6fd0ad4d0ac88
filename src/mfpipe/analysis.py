"""Glue from the statistics stores (and the model) to the rollout results of paper Sec. 4 and its appendices.

Held-out protocol (Sec. 4.1, App. E): every corpus quantity a prediction uses -- the kernel ``P``, the
co-occurrence counts, ``mu``, the measured reads ``zbar``, the centroids fed to the teacher-forced
estimators, the rogue dimensions -- comes from the ``stats`` half; the truth a prediction is scored against
(the centroids ``c^l``, the measured ``sum_h zbar``) comes from the ``eval`` half. The descriptive
diagnostics (clustering and Jensen gap, App. D; anisotropy, App. H; MLP gap, App. K) describe one half,
the ``eval`` half by default. Attention-mass coverage (App. F) describes the kernel, i.e. the ``stats`` half.

Evaluation set: the tracked types with at least ``min_count`` occurrences in the statistics half AND in the
evaluation half (:func:`eval_types`); on the primary corpus that is every tracked type. A type with no
occurrence in the statistics half (possible for a cross corpus, App. G) has no kernel row; it is given the
average row of the others (``P``'s mean over the defined rows, so ``meanq`` is unchanged) so the rollout
stays finite, and it is never scored.

Tables are long-format :class:`pandas.DataFrame` s (one row per kernel / estimator, depth and metric); the
``*_summary`` functions reduce them to the cross-layer mean and standard error over layers (Table 1).
Depths: a residual depth ``l`` (``0..L``; ``L`` = final residual before the last norm) is the input of block
``l``; the rollout is scored at depths ``1..L``; per-block quantities (teacher-forced attention, MLP gap,
Jensen gap) are indexed by the block ``layer = 0..L-1``. ``frac_depth`` is ``depth / L`` for residual depths
and ``(layer + 1) / L`` (the depth the block writes to) for per-block quantities.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import diagnostics as D
from . import kernels as K
from . import metrics as M
from . import rollout as R
from .stats.api import MeanFieldStats, ProvenanceError, open_stats

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_KERNELS",
    "ROLLOUT_NAMES",
    "BASELINE_LABELS",
    "open_pair",
    "check_model",
    "eval_types",
    "RolloutSetup",
    "prepare",
    "retarget",
    "build_kernel",
    "context_free_prediction",
    "run_rollouts",
    "rollout_summary",
    "claim_check",
    "summary_markdown",
    "teacher_forced_table",
    "error_decomposition_predictions",
    "error_decomposition_table",
    "error_decomposition_markdown",
    "mlp_gap_table",
    "clustering_table",
    "anisotropy_table",
    "attention_coverage",
    "cross_corpus",
    "cross_corpus_summary",
    "per_layer_summary",
    "ProvenanceError",
]

#: Table 1 rows in paper order. ``context_free`` is no kernel: it is the model's own residual at position 1 of
#: ``[BOS, t]`` (:func:`mfpipe.rollout.context_free_residuals`), scored like a rollout's prediction.
DEFAULT_KERNELS: tuple[str, ...] = ("mean_field", "context_free", "cooc", "meanq", "uniform", "rowshuffle", "P0only",
                                    "Pavg")
#: every name :func:`run_rollouts` accepts: the Table 1 rows plus the optional ``context_free_kernel`` ablation
#: (the ``[BOS, t]`` attention rolled out from the mean-field start, :mod:`mfpipe.kernels`). It is not a default
#: row: on rotary models it reproduces ``context_free`` (the start is the same embedding) and on GPT-2 it differs
#: from it only by the start's position offset, so it would add a near-duplicate row the paper does not have.
ROLLOUT_NAMES: tuple[str, ...] = (*DEFAULT_KERNELS, *(k for k in K.KERNEL_NAMES if k not in DEFAULT_KERNELS))
#: display names (paper spelling)
BASELINE_LABELS: dict[str, str] = {
    "mean_field": "Mean field",
    "context_free": "Context-free",
    "context_free_kernel": "Context-free kernel, mean-field start",
    "cooc": "cooc",
    "meanq": "meanq",
    "uniform": "uniform",
    "rowshuffle": "rowshuffle",
    "P0only": "P0only",
    "Pavg": "Pavg",
}
METRIC_LABELS: dict[str, str] = {
    "cosine": "centered cosine",
    "rsa": "RSA",
    "rel_error": "centered rel. error",
    "norm_ratio": "centered norm ratio",
}
# higher is better for cosine / rsa, lower for rel_error; norm_ratio is best at 1
_BETTER = {"cosine": "max", "rsa": "max", "rel_error": "min", "norm_ratio": "one"}


# ------------------------------------------------------------------------------------------- stores
def _open(store, expect: Mapping[str, Any] | None) -> MeanFieldStats:
    if isinstance(store, MeanFieldStats):
        from .stats.api import check_provenance

        check_provenance(store.attrs, expect, store.path or "")
        return store
    return open_stats(store, expect=expect)


def _pair_expect(st: MeanFieldStats, half: str, same_corpus: bool = False) -> dict[str, Any]:
    a = st.attrs
    exp = {"half": half, "model": a.get("model"), "revision": a.get("revision"),
           "tracked_fingerprint": a.get("tracked_fingerprint"), "n_tracked": st.n,
           "context_length": a.get("context_length")}
    if same_corpus and a.get("corpus_fingerprint") is not None:
        exp["corpus_fingerprint"] = a["corpus_fingerprint"]
    return {k: v for k, v in exp.items() if v is not None}


def open_pair(stats_store, eval_store, *, model: str | None = None, revision: str | None = None,
              same_corpus: bool = True, reference: MeanFieldStats | None = None
              ) -> tuple[MeanFieldStats, MeanFieldStats]:
    """Open (statistics half, evaluation half) and refuse a mismatched pair (:class:`ProvenanceError`).

    The statistics store must be a ``stats`` half (of ``model`` @ ``revision`` when given); the evaluation
    store an ``eval`` half of the same model, revision, tracked set (fingerprint and N) and context length,
    and -- with ``same_corpus`` -- of the same corpus (fingerprint). ``reference`` (e.g. the primary corpus's
    statistics store) additionally pins model, revision, tracked set and context length of both."""
    exp: dict[str, Any] = {"half": "stats"}
    if model is not None:
        exp["model"] = model
    if revision is not None:
        exp["revision"] = revision
    if reference is not None:
        exp.update({k: v for k, v in _pair_expect(reference, "stats").items() if k != "half"})
    st = _open(stats_store, exp)
    ev = _open(eval_store, _pair_expect(st, "eval", same_corpus))
    return st, ev


def check_model(adapter, st: MeanFieldStats) -> None:
    """Refuse a statistics store computed for another architecture / shape than ``adapter``'s model."""
    a = st.attrs
    want = {"model_type": adapter.model_type, "n_layers": adapter.n_layers, "n_heads": adapter.n_heads,
            "d_model": adapter.d_model, "d_head": adapter.d_head}
    for k, v in want.items():
        if k in a and str(a[k]) != str(v):
            raise ProvenanceError(
                f"statistics store {st.path} was computed for {k}={a[k]!r}, but the model given has {k}={v!r}; "
                "it belongs to another model -- point to the right store or rerun the stats stage")
    if st.n_layers != adapter.n_layers or st.d_model != adapter.d_model:
        raise ProvenanceError(f"statistics store {st.path} has L={st.n_layers}, d={st.d_model}; the model has "
                              f"L={adapter.n_layers}, d={adapter.d_model}")


def eval_types(st: MeanFieldStats, ev: MeanFieldStats, min_count: int = 1) -> np.ndarray:
    """Indices (bucket ranks) of the tracked types scored: ``>= min_count`` occurrences in both halves."""
    m = max(int(min_count), 1)
    ok = (st.query_count().values >= m) & (ev.query_count().values >= m)
    return np.flatnonzero(ok)


def _fill_rows(x: np.ndarray, ok: np.ndarray, axis: int) -> np.ndarray:
    """Rows (along ``axis``) not in ``ok`` replaced by the mean of the ``ok`` rows; NaN -> 0 elsewhere."""
    x = np.array(x, dtype=np.float64)
    if ok.all():
        return x
    if not ok.any():
        raise ValueError("no tracked type occurs in the statistics half")
    xm = np.moveaxis(x, axis, 0)
    xm[~ok] = np.nanmean(xm[ok], axis=0)
    return np.moveaxis(xm, 0, axis)


# ------------------------------------------------------------------------------------------- rollout
@dataclass
class RolloutSetup:
    """Everything a rollout over one statistics half needs (and the truth of one evaluation half)."""

    st: MeanFieldStats
    ev: MeanFieldStats
    P: np.ndarray  # [L, H, N, N+2] float64, rows of types absent from the statistics half filled
    bos: np.ndarray  # [L+1, d] weight-derived b^l
    init: np.ndarray  # [N, d] start of Alg. 1
    types: np.ndarray  # scored type indices
    truth: np.ndarray  # [L+1, N, d] evaluation-half centroids
    stats_centroids: np.ndarray  # [L+1, N, d] statistics-half centroids (absent types filled)
    type_ids: np.ndarray
    bos_id: int
    context_length: int
    meta: dict = field(default_factory=dict)


def prepare(adapter, st: MeanFieldStats, ev: MeanFieldStats, *, init: str = "embed", min_count: int = 1,
            bos: np.ndarray | None = None) -> RolloutSetup:
    """Load the kernel, start and truth of a rollout (``init``: ``"embed"`` = input embeddings, Alg. 1,
    plus GPT-2's mean positional offset over the positions the statistics half's tracked queries occupy;
    ``"stats"`` = the statistics half's layer-0 centroids, as App. G initialises the cross-corpus runs)."""
    check_model(adapter, st)
    check_model(adapter, ev)
    if "bos_id" not in st.attrs:
        raise ProvenanceError(f"statistics store {st.path} records no bos_id; rerun the stats stage")
    bos_id = int(st.attrs["bos_id"])
    T = int(st.attrs["context_length"])
    type_ids = np.asarray(st.ds["query_token_id"].values, dtype=np.int64)
    has_q = st.query_count().values > 0
    P = _fill_rows(st.P().values, has_q, axis=2)
    c_st = _fill_rows(st.centroids().values, has_q, axis=1)
    if bos is None:
        bos = R.bos_residuals(adapter, bos_id)
    if init == "embed":
        x0 = R.initial_centroids(adapter, type_ids, context_length=T,
                                 position_count=st.ds["position_count"].values)
    elif init == "stats":
        x0 = c_st[0].astype(np.float32)
    else:
        raise ValueError(f"init must be 'embed' or 'stats', got {init!r}")
    types = eval_types(st, ev, min_count)
    if types.size < 3:
        raise ValueError(f"only {types.size} tracked types occur >= {min_count} times in both halves; "
                         "RSA and the centred metrics need at least 3")
    meta = {"model": st.attrs.get("model"), "revision": st.attrs.get("revision"),
            "stats_corpus": st.attrs.get("corpus"), "eval_corpus": ev.attrs.get("corpus")}
    return RolloutSetup(st=st, ev=ev, P=P, bos=np.asarray(bos), init=np.asarray(x0), types=types,
                        truth=ev.centroids().values.astype(np.float64), stats_centroids=c_st, type_ids=type_ids,
                        bos_id=bos_id, context_length=T, meta=meta)


def retarget(setup: RolloutSetup, ev: MeanFieldStats, min_count: int = 1) -> RolloutSetup:
    """The same rollout (statistics half, kernel, start) scored against another evaluation half."""
    import dataclasses

    types = eval_types(setup.st, ev, min_count)
    if types.size < 3:
        raise ValueError(f"only {types.size} tracked types occur >= {min_count} times in {setup.st.path} and "
                         f"{ev.path}; the centred metrics need at least 3")
    return dataclasses.replace(setup, ev=ev, types=types, truth=ev.centroids().values.astype(np.float64),
                               meta={**setup.meta, "eval_corpus": ev.attrs.get("corpus")})


def build_kernel(name: str, setup: RolloutSetup, model=None, seed: int = 0) -> np.ndarray:
    """Kernel ``name`` (:data:`mfpipe.kernels.KERNEL_NAMES`) from the statistics half of ``setup``."""
    if name == "context_free":
        raise ValueError("context_free is not a kernel but the [BOS, t] forward itself: use "
                         "context_free_prediction (or the context_free_kernel ablation)")
    if name == "context_free_kernel":
        if model is None:
            raise ValueError("the context_free_kernel ablation needs the model")
        return K.context_free_kernel(model, setup.type_ids, setup.bos_id)
    cooc = setup.st.cooc().values if name == "cooc" else None
    return K.build_kernel(name, setup.P, cooc_counts=cooc, seed=seed)


def context_free_prediction(adapter, setup: RolloutSetup) -> np.ndarray:
    """The paper's context-free baseline for the tracked types of ``setup``: ``[L+1, N, d]`` residuals at
    position 1 of ``[BOS, t]`` (:func:`mfpipe.rollout.context_free_residuals`), in the centroids' convention.
    Corpus-independent: it depends on the model and the tracked set only."""
    return R.context_free_residuals(adapter, setup.type_ids, setup.bos_id)


def _score_rows(pred: np.ndarray, truth: np.ndarray, types: np.ndarray, depths: Sequence[int], n_layers: int,
                per_block: bool = False, **labels) -> list[dict]:
    sc = M.score_layers(pred[:, types], truth[:, types])
    rows = []
    for i, dep in enumerate(depths):
        frac = (dep + 1) / n_layers if per_block else dep / n_layers
        key = "layer" if per_block else "depth"
        for m in M.METRICS:
            rows.append({**labels, key: int(dep), "frac_depth": float(frac), "metric": m,
                         "value": float(sc[m][i]), "n_types": int(types.size)})
    return rows


def _rollout_one(adapter, setup: RolloutSetup, kernel: np.ndarray, pin: tuple | None = None) -> np.ndarray:
    kw = {}
    if pin is not None:
        kw = {"pin_dims": pin[0], "pin_values": pin[1]}
    return R.rollout(adapter, kernel, setup.bos, init=setup.init, **kw)


def _pinning(setup: RolloutSetup, factor: float) -> tuple[np.ndarray, np.ndarray]:
    ok = setup.st.query_count().values > 0
    c = setup.stats_centroids[:, ok]
    return R.rogue_dimensions(c, factor=factor), R.pin_values(c, "mean")


def run_rollouts(model, adapter, stats_store, eval_store, kernels: Sequence[str] = DEFAULT_KERNELS, seed: int = 0,
                 pin: bool = False, rogue_factor: float = 15.0, init: str = "embed", min_count: int = 1,
                 model_name: str | None = None, revision: str | None = None, setup: RolloutSetup | None = None,
                 ) -> pd.DataFrame:
    """Alg. 1 with every kernel in ``kernels``, scored per depth ``1..L`` against the evaluation half.

    ``context_free`` is scored the same way but is no rollout: its prediction is the ``[BOS, t]`` forward
    (:func:`context_free_prediction`). Returns a long table: ``kernel, pinned, n_pinned, depth, frac_depth,
    metric, value, n_types`` (+ ``model``, ``revision``). With ``pin`` every kernel is also run with the rogue
    dimensions (App. I: per-dim RMS over the statistics-half centroids above ``rogue_factor`` x the layer median
    at some depth) held at the statistics half's all-type centroid (``pinned=True`` rows, ``n_pinned`` dims;
    none when no dimension qualifies, which is logged). ``context_free`` gets no pinned row: pinning acts
    inside a rollout, and the baseline is the model's own forward."""
    unknown = [k for k in kernels if k not in ROLLOUT_NAMES]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {ROLLOUT_NAMES}")
    if setup is None:
        st, ev = open_pair(stats_store, eval_store, model=model_name, revision=revision)
        setup = prepare(adapter, st, ev, init=init, min_count=min_count)
    L = adapter.n_layers
    pins = [None]
    if pin:
        dims, vals = _pinning(setup, rogue_factor)
        log.info("rogue dimensions (factor %g): %d of %d: %s", rogue_factor, dims.size, adapter.d_model,
                 dims.tolist())
        if dims.size:
            pins.append((dims, vals))
        else:
            log.warning("no rogue dimension at factor %g: the pinned rollouts would equal the plain ones; skipped",
                        rogue_factor)
    rows: list[dict] = []
    labels = dict(model=setup.meta["model"], revision=setup.meta["revision"])
    for name in kernels:
        if name == "context_free":
            pred = context_free_prediction(adapter, setup)
            rows += _score_rows(pred[1:], setup.truth[1:], setup.types, range(1, L + 1), L, **labels, kernel=name,
                                pinned=False, n_pinned=0)
            continue
        Kr = build_kernel(name, setup, model=model, seed=seed)
        K.check_row_stochastic(Kr, atol=1e-4)
        for p in pins:
            pred = _rollout_one(adapter, setup, Kr, p)
            rows += _score_rows(pred[1:], setup.truth[1:], setup.types, range(1, L + 1), L, **labels, kernel=name,
                                pinned=p is not None, n_pinned=0 if p is None else int(p[0].size))
        del Kr
    return pd.DataFrame(rows)


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    vals = list(dict.fromkeys(values))
    return [v for v in order if v in vals] + [v for v in vals if v not in order]


def rollout_summary(df: pd.DataFrame, group: Sequence[str] = ("kernel", "pinned")) -> pd.DataFrame:
    """Table 1: per kernel (and pinning), the cross-layer mean and standard error over layers of every
    metric (``<metric>`` and ``<metric>_se`` columns, SE = std(ddof=1)/sqrt(n_layers), NaN for one layer)."""
    group = [g for g in group if g in df.columns]
    rows = []
    for key, sub in df.groupby(group, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(group, key))
        row["n_layers"] = int(sub["depth" if "depth" in sub else "layer"].nunique())
        for k in ("n_types", "n_pinned"):
            if k in sub:
                row[k] = int(sub[k].max())
        for m in M.METRICS:
            v = sub.loc[sub["metric"] == m].sort_values("depth" if "depth" in sub else "layer")["value"].to_numpy()
            row[m], row[f"{m}_se"] = M.cross_layer_summary(v)
        rows.append(row)
    out = pd.DataFrame(rows)
    if "kernel" in out:
        order = {k: i for i, k in enumerate(_ordered(out["kernel"], DEFAULT_KERNELS))}
        out = out.sort_values(["pinned", "kernel"] if "pinned" in out else ["kernel"],
                              key=lambda s: s.map(order) if s.name == "kernel" else s, kind="stable")
    return out.reset_index(drop=True)


def claim_check(summary: pd.DataFrame, reference: str = "mean_field", tol: float = 1e-9) -> dict[str, Any]:
    """Is the mean field best on both metrics of Table 1 (cross-layer centred cosine: highest; relative
    error: lowest) among the unpinned kernels? Per metric: the reference value, the best other kernel, the
    kernels tied with the reference (within ``tol``; e.g. ``P0only`` and ``Pavg`` ARE ``P`` when L = 1) and
    ``holds`` (no other kernel better, and at least one not tied); ``holds`` overall = both metrics."""
    s = summary[~summary["pinned"].astype(bool)] if "pinned" in summary else summary
    s = s.set_index("kernel")
    if reference not in s.index or len(s) < 2:
        return {"holds": None}
    out: dict[str, Any] = {}
    for m, sign in (("cosine", 1.0), ("rel_error", -1.0)):
        others = s.drop(index=reference)[m].dropna()
        ref = float(s.loc[reference, m])
        gain = sign * (ref - others)  # > 0: the mean field is better
        ties = sorted(gain.index[gain.abs() <= tol])
        rest = gain.drop(index=ties)
        best = (others.idxmax() if sign > 0 else others.idxmin()) if rest.empty else \
            (others.loc[rest.index].idxmax() if sign > 0 else others.loc[rest.index].idxmin())
        ok = bool((gain >= -tol).all() and not rest.empty and (rest > 0).all())
        out[m] = {"mean_field": ref, "best_baseline": best, "best_baseline_value": float(others.loc[best]),
                  "ties": ties, "holds": ok}
    out["holds"] = all(out[m]["holds"] for m in ("cosine", "rel_error"))
    return out


def _fmt(v: float, se: float | None = None, digits: int = 3) -> str:
    if v is None or not np.isfinite(v):
        return "–"
    s = f"{v:.{digits}f}"
    if se is not None and np.isfinite(se):
        s += f" ({se:.{digits}f})"
    return s


def summary_markdown(summary: pd.DataFrame, title: str | None = None) -> str:
    """Table 1 as Markdown: ``mean (SE over layers)`` per metric, the best value per metric in bold, then a
    one-line check of the paper's central claim."""
    s = summary.copy()
    best = {}
    base = s[~s["pinned"]] if "pinned" in s else s
    for m, b in _BETTER.items():
        col = base[m].dropna()
        if col.empty:
            continue
        best[m] = col.max() if b == "max" else col.min() if b == "min" else col.iloc[(col - 1).abs().argmin()]
    head = ["kernel"] + [METRIC_LABELS[m] for m in M.METRICS]
    lines = []
    if title:
        lines += [f"**{title}**", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(M.METRICS)) + "|"]
    for _, r in s.iterrows():
        name = BASELINE_LABELS.get(r["kernel"], r["kernel"])
        if r.get("pinned", False):
            name += f" (pinned, {int(r['n_pinned'])} dims)" if "n_pinned" in r else " (pinned)"
        cells = []
        for m in M.METRICS:
            c = _fmt(r[m], r[f"{m}_se"])
            if not r.get("pinned", False) and m in best and np.isfinite(r[m]) and r[m] == best[m]:
                c = f"**{c}**"
            cells.append(c)
        lines.append("| " + " | ".join([name] + cells) + " |")
    n_layers = int(s["n_layers"].max()) if "n_layers" in s and len(s) else 0
    n_types = int(s["n_types"].max()) if "n_types" in s and len(s) else 0
    lines += ["", f"Cross-layer mean (standard error over {n_layers} layer(s)) of the rollout scored against the "
                  f"held-out centroids of {n_types} tracked types; best unpinned value per metric in bold "
                  "(norm ratio: closest to 1)."]
    chk = claim_check(summary)
    if chk.get("holds") is not None:
        parts = []
        for m in ("cosine", "rel_error"):
            c = chk[m]
            tie = f"; identical: {', '.join(c['ties'])}" if c["ties"] else ""
            parts.append(f"{METRIC_LABELS[m]} {c['mean_field']:.3f} vs best other kernel "
                         f"{BASELINE_LABELS.get(c['best_baseline'], c['best_baseline'])} "
                         f"{c['best_baseline_value']:.3f} ({'holds' if c['holds'] else 'does not hold'}{tie})")
        note = ""
        if any(chk[m]["ties"] for m in ("cosine", "rel_error")) and n_layers == 1:
            note = " With one layer P0only and Pavg are the mean field itself."
        lines += ["", f"Mean field strictly best on both metrics against every other kernel that differs from it: "
                      f"**{'yes' if chk['holds'] else 'no'}** — " + "; ".join(parts) + "." + note]
    return "\n".join(lines) + "\n"


def per_layer_summary(df: pd.DataFrame, by: str) -> pd.DataFrame:
    """Cross-layer mean and SE of each metric per value of ``by`` (e.g. ``estimator``)."""
    rows = []
    key = "depth" if "depth" in df else "layer"
    for name, sub in df.groupby(by, sort=False):
        row = {by: name, "n_layers": int(sub[key].nunique())}
        for m in M.METRICS:
            v = sub.loc[sub["metric"] == m].sort_values(key)["value"].to_numpy()
            row[m], row[f"{m}_se"] = M.cross_layer_summary(v)
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------- error accounting
def _nan0(x) -> np.ndarray:
    return np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0)


def teacher_forced_table(adapter, setup: RolloutSetup) -> pd.DataFrame:
    """Fig. tf-attention: per block, ``sum_h zhat_s^{lh} W_O`` predicted from the statistics half's kernel and
    centroids vs the evaluation half's measured ``sum_h zbar_s^{lh} W_O``; all four centred metrics.
    Long table ``layer, frac_depth, metric, value, n_types``."""
    L = adapter.n_layers
    zbar_eval = _nan0(setup.ev.zbar().values)
    pred, meas = R.teacher_forced_attention(adapter, setup.P, setup.stats_centroids[:L], setup.bos, zbar_eval)
    return pd.DataFrame(_score_rows(pred, meas, setup.types, range(L), L, per_block=True,
                                    model=setup.meta["model"], revision=setup.meta["revision"]))


#: Sec. 4.3 estimators; (b) is labelled for what it computes (unconditional mu_t for E_s[vbar_t])
ESTIMATORS = {"a": "(a) exact attention, MLP at centroid",
              "b": "(b) + value map at centroid, unconditional value means mu_t",
              "c": "(c) full mean field"}


def error_decomposition_predictions(adapter, setup: RolloutSetup) -> dict[str, np.ndarray]:
    """The nested estimators (a)(b)(c) of Sec. 4.3 (:func:`mfpipe.rollout.error_decomposition`), ``{"a", "b",
    "c"} -> [L, N, d]`` (entry ``l`` predicts ``c^{l+1}``). Every input comes from the STATISTICS half: the kernel
    ``P``, the true centroids ``c^l`` the block is applied at (also valuing ``v(c_t)`` and ``<other>``'s
    ``cbar``), the measured reads ``zbar`` (a, b) and the value means ``mu`` (b); ``b^l`` is weight-derived.
    Only the truth they are scored against, ``c^{l+1}``, comes from the evaluation half."""
    st = setup.st
    return R.error_decomposition(adapter, setup.P, setup.stats_centroids, setup.bos, _nan0(st.zbar().values),
                                 _nan0(st.mu().values))


def error_decomposition_table(adapter, setup: RolloutSetup) -> pd.DataFrame:
    """Fig. error-decomp: the estimators of :func:`error_decomposition_predictions` (statistics half), each
    scored against the evaluation half's ``c^{l+1}``. Long table ``estimator, label, layer, frac_depth,
    metric, value, n_types`` (``label``: :data:`ESTIMATORS`)."""
    L = adapter.n_layers
    out = error_decomposition_predictions(adapter, setup)
    rows = []
    for k in ("a", "b", "c"):
        rows += _score_rows(out[k], setup.truth[1:], setup.types, range(L), L, per_block=True,
                            model=setup.meta["model"], revision=setup.meta["revision"], estimator=k,
                            label=ESTIMATORS[k])
    return pd.DataFrame(rows)


def error_decomposition_markdown(ed: pd.DataFrame, tag: str) -> str:
    """The per-layer and cross-layer tables of :func:`error_decomposition_table`, estimators by label."""
    wide = long_to_wide(ed, "layer", by="estimator")
    wide["estimator"] = wide["estimator"].map(ESTIMATORS)
    md = wide_markdown(wide, "estimator", ["layer", "cosine", "rsa", "rel_error", "norm_ratio"],
                       title=f"Per-layer error accounting, estimators (a)(b)(c) vs held-out c^(l+1): {tag}")
    summ = per_layer_summary(ed, "estimator")
    summ["estimator"] = summ["estimator"].map(ESTIMATORS)
    md += "\n" + wide_markdown(summ, "estimator", ["cosine", "cosine_se", "rel_error", "rel_error_se"],
                               title="Cross-layer mean (SE over layers)")
    md += ("\nInputs (P, c^l, zbar, mu) from the statistics half; truth c^(l+1) from the evaluation half. (b) uses "
           "the unconditional value means mu_t in place of E_s[vbar_t] (the paper's (b)), so it also assumes "
           "value-query independence.\n")
    return md


def _store_types(store: MeanFieldStats, min_count: int = 1) -> np.ndarray:
    return np.flatnonzero(store.query_count().values >= max(int(min_count), 1))


def mlp_gap_table(adapter, store: MeanFieldStats, min_count: int = 1) -> pd.DataFrame:
    """App. K ``tab:mlp-gap``: per block, the MLP applied once at the mean input (post-attention residual;
    GPT-NeoX parallel: the block input) vs the occurrence mean of the MLP branch, centred metrics over the
    types of ``store`` with ``>= min_count`` occurrences. Columns ``layer, frac_depth, cosine, rsa,
    rel_error, norm_ratio, n_types``."""
    check_model(adapter, store)
    L = adapter.n_layers
    g = store.mlp_gap()
    m_in = D.mlp_input_means(adapter, store.centroids().values, g["m"].values)
    types = _store_types(store, min_count)
    sc = D.mlp_gap(adapter, _nan0(m_in), _nan0(g["mlp_out"].values), types=types)
    df = pd.DataFrame({"layer": np.arange(L), "frac_depth": (np.arange(L) + 1) / L,
                       **{m: sc[m] for m in M.METRICS}})
    df["n_types"] = types.size
    return _label(df, store)


def _label(df: pd.DataFrame, store: MeanFieldStats) -> pd.DataFrame:
    df.insert(0, "half", store.attrs.get("half"))
    df.insert(0, "revision", store.attrs.get("revision"))
    df.insert(0, "model", store.attrs.get("model"))
    return df


def clustering_table(adapter, store: MeanFieldStats, min_count: int = 1) -> pd.DataFrame:
    """App. D ``fig:clustering`` per residual depth ``0..L``: relative RMS deviation of occurrences about their
    type centroid (median and IQR over types), eta^2 (raw) and eta^2_z (per-dimension z-scored), and for the
    block inputs ``0..L-1`` the value-map Jensen gap of the attention-input norm (relative magnitude and
    direction ``1 - cos``, median and IQR over types; NaN at depth ``L``)."""
    check_model(adapter, store)
    L = adapter.n_layers
    types = _store_types(store, min_count)
    n = store.key_count().values[: store.n][types].astype(np.float64)
    c = store.centroids().values.astype(np.float64)[:, types]
    var = np.maximum(store.resid_var().values.astype(np.float64)[:, types], 0.0)
    cl = D.clustering_metrics(n, c * n[:, None], (var + c * c) * n[:, None])
    rr = D.gap_summary(cl["rel_rms"], axis=-1)
    df = pd.DataFrame({"depth": np.arange(L + 1), "frac_depth": np.arange(L + 1) / L,
                       "rel_rms_median": rr["median"], "rel_rms_q25": rr["q25"], "rel_rms_q75": rr["q75"],
                       "eta2": cl["eta2"], "eta2_z": cl["eta2_z"]})
    ln = store.ln_in().values.astype(np.float64)[:, types]
    for k in ("rel", "dir"):
        for q in ("median", "q25", "q75"):
            df[f"jensen_{k}_{q}"] = np.nan
    if np.isfinite(ln).all():
        jg = D.value_jensen_gap(adapter, ln, c[:L])
        for k in ("rel", "dir"):
            s = D.gap_summary(jg[k], axis=-1)
            for q in ("median", "q25", "q75"):
                df.loc[df["depth"] < L, f"jensen_{k}_{q}"] = s[q]
    else:
        log.warning("store %s has no attention-input norm means (ln_in_mean NaN): Jensen gap left NaN", store.path)
    df["n_types"] = types.size
    return _label(df, store)


def anisotropy_table(store: MeanFieldStats, min_count: int = 1) -> pd.DataFrame:
    """App. H ``tab:anisotropy`` per residual depth: ``||cbar||``, mean distance of a type centroid to ``cbar``
    and their ratio (types of ``store`` with ``>= min_count`` occurrences)."""
    types = _store_types(store, min_count)
    c = store.centroids().values.astype(np.float64)[:, types]
    a = D.anisotropy(c)
    L = store.n_layers
    df = pd.DataFrame({"depth": np.arange(L + 1), "frac_depth": np.arange(L + 1) / L, "norm_mean": a["norm_mean"],
                       "mean_dist": a["mean_dist"], "ratio": a["ratio"], "n_types": types.size})
    return _label(df, store)


def attention_coverage(stores: Sequence, expect: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """App. F ``tab:attn-coverage`` from each statistics store's ``P``: average over layers, heads and tracked
    query types (with at least one query) of the attention mass on tracked types, on position 0 and on
    ``<other>``, and the tracked share of non-sink attention ``tracked / (tracked + other)`` (of the averages,
    as the paper's table). One row per store."""
    rows = []
    for s in stores:
        st = _open(s, expect)
        ok = st.query_count().values > 0
        tr = po = ot = 0.0
        for l in range(st.n_layers):
            P = st.P(layer=l).values.astype(np.float64)[:, ok]  # [H, n, K]
            tr += P[..., : st.n].sum(-1).mean()
            po += P[..., st.bos_bucket].mean()
            ot += P[..., st.other_bucket].mean()
        tr, po, ot = tr / st.n_layers, po / st.n_layers, ot / st.n_layers
        a = st.attrs
        rows.append({"model": a.get("model"), "revision": a.get("revision"), "corpus": a.get("corpus"),
                     "half": a.get("half"), "n_tracked": st.n, "tracked": tr, "position0": po, "other": ot,
                     "tracked_share_nonsink": tr / (tr + ot) if tr + ot > 0 else float("nan")})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------- cross-corpus (App. G)
def cross_corpus(model, adapter, corpora: Mapping[str, tuple], primary: str, *, init: str = "embed",
                 min_count: int = 1, context_free: bool = True, model_name: str | None = None,
                 revision: str | None = None) -> pd.DataFrame:
    """App. G matrix: for every statistics corpus X and evaluation corpus Y (``corpora``: name ->
    ``(stats_store, eval_store)``), the mean-field rollout with X's statistics scored per depth against Y's
    evaluation centroids, over the types occurring ``>= min_count`` times in X's statistics half and Y's
    evaluation half. Every store must share the primary corpus's model, revision, tracked set and context
    length. With ``context_free`` the context-free baseline (the ``[BOS, t]`` forward: no corpus statistic, so
    one set of residuals serves every column) is scored against every Y too (``stats_corpus =
    "context-free"``). Long table ``stats_corpus, eval_corpus, depth, frac_depth, metric, value, n_types``; the
    cell (primary, primary) is exactly the plain rollout's ``mean_field`` score and the context-free cell of
    the primary column the plain rollout's ``context_free`` score. ``model`` (the HF model) is not needed any
    more -- the adapter runs every forward -- and is kept for the scripts' call signature."""
    if primary not in corpora:
        raise ValueError(f"primary corpus {primary!r} not among {list(corpora)}")
    L = adapter.n_layers
    ref, _ = open_pair(*corpora[primary], model=model_name, revision=revision)
    opened = {}
    for name, (s, e) in corpora.items():
        opened[name] = open_pair(s, e, reference=ref)
    bos = R.bos_residuals(adapter, int(ref.attrs["bos_id"]))
    rows: list[dict] = []
    setups = {}
    for x, (stx, evx) in opened.items():
        sx = setups[x] = prepare(adapter, stx, evx, init=init, min_count=min_count, bos=bos)
        pred = _rollout_one(adapter, sx, K.mean_field(sx.P))
        for y, (_, evy) in opened.items():
            sy = retarget(sx, evy, min_count)
            rows += _score_rows(pred[1:], sy.truth[1:], sy.types, range(1, L + 1), L, model=sy.meta["model"],
                                revision=sy.meta["revision"], stats_corpus=x, eval_corpus=y)
    if context_free:
        base = setups[primary]
        pred = context_free_prediction(adapter, base)
        for y, (_, evy) in opened.items():
            sy = retarget(base, evy, min_count)
            rows += _score_rows(pred[1:], sy.truth[1:], sy.types, range(1, L + 1), L, model=sy.meta["model"],
                                revision=sy.meta["revision"], stats_corpus="context-free", eval_corpus=y)
    return pd.DataFrame(rows)


def cross_corpus_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (statistics corpus, evaluation corpus): cross-layer mean and SE of every metric."""
    rows = []
    for (x, y), sub in df.groupby(["stats_corpus", "eval_corpus"], sort=False):
        row = {"stats_corpus": x, "eval_corpus": y, "n_layers": int(sub["depth"].nunique()),
               "n_types": int(sub["n_types"].max())}
        for m in M.METRICS:
            v = sub.loc[sub["metric"] == m].sort_values("depth")["value"].to_numpy()
            row[m], row[f"{m}_se"] = M.cross_layer_summary(v)
        rows.append(row)
    return pd.DataFrame(rows)


def matrix_markdown(summary: pd.DataFrame, metric: str = "cosine", title: str | None = None) -> str:
    """The App. G matrix (rows: statistics corpus, columns: evaluation corpus) of one metric, diagonal bold."""
    cols = list(dict.fromkeys(summary["eval_corpus"]))
    rows = list(dict.fromkeys(summary["stats_corpus"]))
    rows = [r for r in rows if r != "context-free"] + [r for r in rows if r == "context-free"]
    idx = summary.set_index(["stats_corpus", "eval_corpus"])
    lines = [f"**{title}**", ""] if title else []
    lines += ["| statistics \\ eval | " + " | ".join(cols) + " |", "|---|" + "|".join("---:" for _ in cols) + "|"]
    for r in rows:
        cells = []
        for c in cols:
            if (r, c) not in idx.index:
                cells.append("–")
                continue
            v = idx.loc[(r, c)]
            s = _fmt(v[metric], v[f"{metric}_se"])
            cells.append(f"**{s}**" if r == c else (f"*{s}*" if r == "context-free" else s))
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines += ["", f"Cross-layer mean (SE over layers) of the {METRIC_LABELS.get(metric, metric)}: mean-field "
                  "rollout with the row corpus's statistics scored against the column corpus's held-out centroids; "
                  "diagonal in bold; *context-free*: the corpus-free baseline."]
    return "\n".join(lines) + "\n"


def wide_markdown(df: pd.DataFrame, index: str, columns: Sequence[str], title: str | None = None,
                  digits: int = 3) -> str:
    """A simple Markdown table of ``df[[index, *columns]]`` (floats to ``digits``)."""
    lines = [f"**{title}**", ""] if title else []
    lines += ["| " + " | ".join([index, *columns]) + " |", "|" + "|".join("---" for _ in range(len(columns) + 1)) + "|"]
    for _, r in df.iterrows():
        cells = [str(r[index])]
        for c in columns:
            v = r[c]
            cells.append(_fmt(float(v), digits=digits) if isinstance(v, (float, np.floating)) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def long_to_wide(df: pd.DataFrame, key: str, by: str | None = None) -> pd.DataFrame:
    """``metric``/``value`` long rows -> one column per metric (``by`` columns kept)."""
    idx = [c for c in (by, key, "frac_depth") if c]
    w = df.pivot_table(index=idx, columns="metric", values="value", sort=False).reset_index()
    w.columns.name = None
    return w[[*idx, *[m for m in M.METRICS if m in w.columns]]]


def write_csv(df: pd.DataFrame, path: str | Path) -> None:
    from .io import atomic_write_text

    atomic_write_text(path, df.to_csv(index=False))


def write_text(text: str, path: str | Path) -> None:
    from .io import atomic_write_text

    atomic_write_text(path, text)
