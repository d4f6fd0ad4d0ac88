"""Error accounting (paper Sec. 4.3, App. D, F, H, K): teacher-forced attention, the nested estimators
(a)(b)(c), the MLP gap, within-type clustering with the value-map Jensen gap, anisotropy and the
attention-mass coverage. Which half each input comes from: see :mod:`mfpipe.experiments.rollout` and each function."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout import diagnostics as D
from mfpipe.experiments.rollout import metrics as M
from mfpipe.experiments.rollout.runs import RolloutSetup, score_rows
from mfpipe.experiments.rollout.tables import ESTIMATORS
from mfpipe.stats.api import MeanFieldStats
from mfpipe.stats.halves import check_model, open_checked_stats, store_types

log = logging.getLogger(__name__)

__all__ = ["teacher_forced_table", "pass2_value_terms", "error_decomposition_predictions", "error_decomposition_table", "mlp_gap_table",
           "clustering_table", "anisotropy_table", "attention_coverage"]


def _nan0(x) -> np.ndarray:
    return np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0)


def teacher_forced_table(adapter, setup: RolloutSetup) -> pd.DataFrame:
    """Fig. tf-attention: per block, ``sum_h zhat_s^{lh} W_O`` predicted from the statistics half's kernel and
    centroids vs the evaluation half's measured ``sum_h zbar_s^{lh} W_O``; all four centred metrics.
    Long table ``layer, frac_depth, metric, value, n_types``."""
    L = adapter.n_layers
    zbar_eval = _nan0(setup.ev.zbar().values)
    pred, meas = R.teacher_forced_attention(adapter, setup.P, setup.stats_centroids[:L], setup.bos, zbar_eval)
    return _with_kinds(pd.DataFrame(score_rows(pred, meas, setup.types, range(L), L, per_block=True,
                                               model=setup.meta["model"], revision=setup.meta["revision"])),
                       getattr(adapter, "layer_kinds", ()))


def pass2_value_terms(setup: RolloutSetup, deviation) -> tuple[np.ndarray, np.ndarray]:
    """(``vbar [L, H, N, dh]`` = sum_{t<N} P_st E_s[vbar_t] on the kernel's support, ``support [N, N]``) from pass
    2's deviation store of the same (model, revision, statistics half) as ``setup.st``; refused otherwise."""
    from mfpipe.stats.api import ProvenanceError

    st = setup.st
    for key in ("model", "revision", "tracked_fingerprint", "corpus_fingerprint"):
        if str(deviation.attrs.get(key)) != str(st.attrs.get(key)):
            raise ProvenanceError(f"deviation store ({key}={deviation.attrs.get(key)!r}) is not pass 2 of statistics "
                                  f"store {st.path} ({key}={st.attrs.get(key)!r}); rerun its deviation jobs")
    N = len(setup.type_ids)
    support = st.context_count().values[:, :N] >= int(deviation.attrs["min_count"])
    return _nan0(deviation["vbar_tracked"].transpose("layer", "head", "query", "head_dim").values), support


@R.on_types
def error_decomposition_predictions(adapter, setup: RolloutSetup, deviation=None) -> dict[str, np.ndarray]:
    """The nested estimators (a)(b)(c) of Sec. 4.3 (:func:`mfpipe.experiments.rollout.algorithm.error_decomposition`), ``{"a", "b",
    "c"} -> [L, N, d]`` (entry ``l`` predicts ``c^{l+1}``). Every input comes from the STATISTICS half: the kernel
    ``P``, the true centroids ``c^l`` the block is applied at (also valuing ``v(c_t)`` and ``<other>``'s
    ``cbar``), the measured reads ``zbar`` (a, b) and, for (b), pass 2's ``sum_t P_st E_s[vbar_t]`` when its
    ``deviation`` store is given (the paper's (b)), else the value means ``mu``; ``b^l`` is weight-derived.
    Only the truth they are scored against, ``c^{l+1}``, comes from the evaluation half."""
    st = setup.st
    vbar, support = pass2_value_terms(setup, deviation) if deviation is not None else (None, None)
    return R.error_decomposition(adapter, setup.P, setup.stats_centroids, setup.bos, _nan0(st.zbar().values),
                                 _nan0(st.mu().values), vbar=vbar, support=support)


def error_decomposition_table(adapter, setup: RolloutSetup, deviation=None) -> pd.DataFrame:
    """Fig. error-decomp: the estimators of :func:`error_decomposition_predictions` (statistics half), each
    scored against the evaluation half's ``c^{l+1}``. Long table ``estimator, label, layer, frac_depth,
    metric, value, n_types`` (``label``: :data:`ESTIMATORS`; (b) says which value means it used)."""
    L = adapter.n_layers
    out = error_decomposition_predictions(adapter, setup, deviation)
    labels = dict(ESTIMATORS, b=ESTIMATORS["b_pass2"]) if deviation is not None else ESTIMATORS
    rows = []
    for k in ("a", "b", "c"):
        rows += score_rows(out[k], setup.truth[1:], setup.types, range(L), L, per_block=True,
                            model=setup.meta["model"], revision=setup.meta["revision"], estimator=k,
                            label=labels[k])
    return _with_kinds(pd.DataFrame(rows), getattr(adapter, "layer_kinds", ()))


def mlp_gap_table(adapter, store: MeanFieldStats, min_count: int = 1) -> pd.DataFrame:
    """App. K ``tab:mlp-gap``: per block, the MLP applied once at the mean input (post-attention residual;
    GPT-NeoX parallel: the block input) vs the occurrence mean of the MLP branch, centred metrics over the
    types of ``store`` with ``>= min_count`` occurrences. Columns ``layer, frac_depth, cosine, rsa,
    rel_error, norm_ratio, n_types``; NaN readings where the blocks join their branches in a form of their own
    (Doge's, MiniMax's: :mod:`mfpipe.models.adapters.joins`), whose MLP input the store has no mean of."""
    check_model(adapter, store)
    L = adapter.n_layers
    g = store.mlp_gap()
    m_in = D.mlp_input_means(adapter, store.centroids().values, g["m"].values, g["mlp_out"].values)
    types = store_types(store, min_count)
    sc = D.mlp_gap(adapter, _nan0(m_in), _nan0(g["mlp_out"].values), types=types)
    if adapter.structure.join == "model":  # a join of the block's own (adapters.joins): the MLP's mean input is no
        sc = {m: np.full(L, np.nan) for m in M.METRICS}  # mean of the store's, so no reading (NaN, not a guess)
    df = pd.DataFrame({"layer": np.arange(L), "frac_depth": (np.arange(L) + 1) / L,
                       **{m: sc[m] for m in M.METRICS}})
    df["n_types"] = types.size
    return _label(df, store)


def _with_kinds(df: pd.DataFrame, kinds) -> pd.DataFrame:
    """A hybrid's per-layer table names each layer's kind beside it (its other mixer's rows have no attention
    reading: NaN); a table of attention layers only stays as it was."""
    if "layer" in df.columns and any(k != "attention" for k in kinds):
        df.insert(int(df.columns.get_loc("layer")) + 1, "layer_kind", [kinds[int(l)] for l in df["layer"]])
    return df


def _label(df: pd.DataFrame, store: MeanFieldStats) -> pd.DataFrame:
    _with_kinds(df, getattr(store, "layer_kinds", ()))
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
    types = store_types(store, min_count)
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
    types = store_types(store, min_count)
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
        st = open_checked_stats(s, expect)
        ok = st.query_count().values > 0
        tr = po = ot = 0.0
        A = getattr(st, "attention_layers", range(st.n_layers))  # a hybrid's other layers have no P
        for l in A:
            P = st.P(layer=l).values.astype(np.float64)[:, ok]  # [H, n, K]
            tr += P[..., : st.n].sum(-1).mean()
            po += P[..., st.bos_bucket].mean()
            ot += P[..., st.other_bucket].mean()
        tr, po, ot = tr / len(A), po / len(A), ot / len(A)
        a = st.attrs
        rows.append({"model": a.get("model"), "revision": a.get("revision"), "corpus": a.get("corpus"),
                     "half": a.get("half"), "n_tracked": st.n, "tracked": tr, "position0": po, "other": ot,
                     "tracked_share_nonsink": tr / (tr + ot) if tr + ot > 0 else float("nan")})
    return pd.DataFrame(rows)
