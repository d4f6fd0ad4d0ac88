"""The positional job's streamed collection (issue 58) against the all-at-once computation it replaced: on tiny GPT-2
(a learned position table: posVar, the W_pos share, the ridge decode) and Llama (rotary) models, every head's row,
the cluster, its readings, the curves, S and the readings' inputs from :func:`stream.analyse` (two passes of sums
and the cluster heads' occurrences) equal :func:`collect.collect`'s occurrences held whole run through
:func:`analysis.head_table` and friends: bit for bit where the same numbers are read, within float64 rounding where a
least-squares fit is solved from sums instead of rows. The cell-grouped share against an occurrence-level lstsq."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from stats_reference import tiny_stats_half, zipf_windows

from mfpipe.experiments.positional import analysis as An
from mfpipe.experiments.positional import cells as Ce
from mfpipe.experiments.positional import collect as C
from mfpipe.experiments.positional import fits as F
from mfpipe.experiments.positional import stream as St
from mfpipe.experiments.positional import tables as Tb
from mfpipe.meanfield.kernel import kernel_from_store

T_CTX = 32
BASE = dict(min_position=4, max_other=0.85, posvar_threshold=0.0, carrier_threshold=0.0, wpos_components=6,
            write_rank=2, ablation_dim=3, ridge_alpha=1.0, seed=3)
# every head a cluster head (the second pass keeps all of them) / the top two by S̄ (a subset of the heads)
CFGS = {"all": dict(BASE, top_fraction=1.0, min_top=1), "top2": dict(BASE, top_fraction=0.25, min_top=1)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def ran(request, tmp_path_factory):
    _, ad, _, tracked, _, _, st = tiny_stats_half(request.param, tmp_path_factory.mktemp("stream"), model_seed=5,
                                                  n_windows=24, token_seed=1, batch_size=8, context_length=T_CTX)
    ev = zipf_windows(24, T=T_CTX, seed=2).astype(np.int64)
    kernel = kernel_from_store(st, tracked, min_count=1)
    zbar = torch.from_numpy(np.asarray(st.zbar().transpose("query", "layer", "head", "head_dim").values, np.float32))
    w, p = C.sample_occurrences(len(ev), T_CTX, stride=1, min_position=1, budget=10**6, seed=1)
    args = (ad, kernel, zbar, ev, tracked.query_bucket_lut(), w, p)
    O = np.stack([ad.out_proj_slices(l).double().numpy() for l in range(ad.n_layers)])
    W = ad.position_table()
    W_pos = None if W is None else W.double().numpy()[:T_CTX]
    S_bar = np.random.default_rng(4).permutation(ad.n_layers * ad.n_heads).reshape(ad.n_layers, ad.n_heads) * 1.0
    return dict(ad=ad, args=args, occ=C.collect(*args, batch_size=5), O=O, W_pos=W_pos, S_bar=S_bar)


def _reference(ran, cfg):
    """The all-at-once computation: the occurrences held whole, every reading from them."""
    occ, O, W_pos = ran["occ"], ran["O"], ran["W_pos"]
    heads = An.head_table(occ, O, W_pos, ran["S_bar"], T_CTX, cfg)
    cl, car = An.cluster(heads, cfg)
    return heads, cl, car


def _close(a: pd.DataFrame, b: pd.DataFrame, exact, rtol=1e-9, atol=1e-12, loose=()):
    """``a`` equals ``b``: the ``exact`` columns bit for bit, the rest within float64 rounding (``loose`` columns, a
    rounding amplified by a condition number, within 1e-7)."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    pd.testing.assert_frame_equal(a[exact], b[exact], check_exact=True)
    for col in a.columns.difference(exact):
        tol = (1e-7, 1e-9) if col in loose else (rtol, atol)
        np.testing.assert_allclose(a[col].astype(float), b[col].astype(float), rtol=tol[0], atol=tol[1], err_msg=col)


@pytest.mark.parametrize("which", sorted(CFGS))
def test_streamed_readings_equal_the_all_at_once_computation(ran, which):
    cfg, O, W_pos, full = CFGS[which], ran["O"], ran["W_pos"], ran["occ"]
    heads_ref, cl_ref, car_ref = _reference(ran, cfg)
    prepared = C.prepare(*ran["args"])
    occ, heads, cl, car, ctab, sums = St.analyse(ran["ad"], prepared, O, W_pos, ran["S_bar"], T_CTX, cfg,
                                                 batch_size=4)
    assert occ.delta is None and sums.heads == cl  # no Δ held: the cluster's heads' sums only
    assert len(cl) == (8 if which == "all" else 2)
    # counts, the S̄ ranks, mean D and the flags: the same numbers read; least squares from sums: float64 rounding
    _close(heads, heads_ref, ["layer", "head", "n", "S_bar", "S_rank", "D_natural", "wpos"])
    assert (heads_ref["n"] > 12).all() and (heads_ref["n"] < len(full)).any()  # the masks drop some, every head fits
    assert heads["decode_r2"].isna().all() == (W_pos is None) and heads["posvar"].notna().all()
    assert (cl, car) == (cl_ref, car_ref)
    # the readings' per-occurrence inputs (mean D natural, the class test) are the same arrays
    for f in ("window", "position", "query_type", "D", "other", "valid"):
        np.testing.assert_array_equal(getattr(occ, f), getattr(full, f), err_msg=f)
    # the cluster's readings, its curves and S from the cells' sums against the occurrences' rows
    ref = An.cluster_tables(full, O, W_pos, T_CTX, cl, cfg)
    keep = An.head_masks(full, cfg["min_position"], cfg["max_other"])
    rows_ref = ref["rows"].copy()
    for i, (l, h) in enumerate(zip(rows_ref["layer"], rows_ref["head"])):
        # a write's norm and leading coefficient are functions of p: the rows' fits break those ties by rounding
        # noise (up to 1e-4 on Spearman's rho here), the cells' keep them, so the reference takes them tied too
        fit, p = ref["fits"][(l, h)], full.position[keep[:, l, h]]
        for col, v in (("spearman_norm_p", np.linalg.norm(fit, axis=1)),
                       ("spearman_lead_p", fit @ F.principal(fit)[1][:, 0])):
            tied = (pd.Series(v).groupby(p).transform("mean")).to_numpy()
            assert abs(An.spearman(v, p) - rows_ref.loc[i, col]) < 1e-12 and np.ptp(v - tied) < 1e-9 * np.ptp(v)
            rows_ref.loc[i, col] = An.spearman(tied, p)
    # the leading axis's sign is the eigensolver's (tables.curves: "a curve may come out mirrored"): a head's
    # Spearman of the leading coefficient and its curve flip together
    sign = np.sign(ctab["rows"]["spearman_lead_p"].to_numpy() * rows_ref["spearman_lead_p"].to_numpy())
    rows_ref["spearman_lead_p"] *= sign
    _close(ctab["rows"], rows_ref, ["layer", "head", "n", "offset_median", "spearman_a_p"])
    _close(ctab["overlaps"], ref["overlaps"], ["head_a", "head_b", "chance"], loose=("readout_cos",))
    assert ctab["model"] == pytest.approx(ref["model"], nan_ok=True)
    curves_ref = Tb.curves(full, O, W_pos, T_CTX, cl, cfg, n_bins=4)
    flip = dict(zip([f"L{l}H{h}" for l, h in zip(rows_ref["layer"], rows_ref["head"])], sign))
    curves_ref["lead_mean"] *= curves_ref["head"].map(flip)
    _close(Ce.curves(sums, ctab["fits"], cl, cfg, n_bins=4), curves_ref, ["head", "n"])
    for l, h in cl:  # each occurrence's row of the positional write (the cells' in position order)
        fit, order = ctab["fits"][(l, h)], np.argsort(full.position[keep[:, l, h]], kind="stable")
        np.testing.assert_allclose(np.repeat(fit.rows, fit.w, axis=0), ref["fits"][(l, h)][order], rtol=1e-9,
                                   atol=1e-12)
    (S, share), (S_ref, share_ref) = (Ce.union_subspace(ctab["fits"], car, 3, O.shape[-1]),
                                      An.union_subspace(ref["fits"], car, 3, O.shape[-1]))
    assert S.shape == S_ref.shape and share == pytest.approx(share_ref, rel=1e-9)
    np.testing.assert_allclose(S @ S.T, S_ref @ S_ref.T, atol=1e-9)  # the same span (each axis's sign is free)


def test_the_second_pass_runs_only_for_a_cluster_or_a_decode(ran, monkeypatch):
    """No cluster (posVar never reaches 2): a rotary model's job makes one pass; a learned position table's makes the
    second for its decode alone (no cluster head's sums)."""
    cfg = dict(CFGS["all"], posvar_threshold=2.0)
    calls, second = [], St.second_pass
    monkeypatch.setattr(St, "second_pass", lambda *a, **k: calls.append(a[2]) or second(*a, **k))
    occ, heads, cl, car, ctab, sums = St.analyse(ran["ad"], C.prepare(*ran["args"]), ran["O"], ran["W_pos"],
                                                 ran["S_bar"], T_CTX, cfg, batch_size=6)
    assert cl == car == [] and occ.delta is None and len(ctab["rows"]) == 0 and sums.heads == []
    assert calls == ([] if ran["W_pos"] is None else [[]])
    assert heads["decode_r2"].notna().all() == (ran["W_pos"] is not None)


@pytest.mark.parametrize("k", [3, 10, 14])
def test_cell_share_equals_the_occurrence_level_fit(k):
    """Occurrences grouped by cell (regressors a function of the cell): the share from per-cell sums against
    :func:`fits.explained_share` on the rows; 14 regressors on 9 cells is rank-deficient (the projection still
    unique)."""
    rng = np.random.default_rng(k)
    cells, m, n = 9, 5, 400
    Xc = rng.normal(size=(cells, k))
    cell = rng.integers(0, cells, size=n)
    Y = rng.normal(size=(n, m)) + Xc[cell, :1] * rng.normal(size=m) + 3.0
    A = rng.normal(size=(m, m))
    G = A @ A.T
    count = np.bincount(cell, minlength=cells)
    sums = np.zeros((cells, m))
    np.add.at(sums, cell, Y)
    share = Ce.cell_share(count, Xc, sums, Y.T @ Y, G)
    assert share == pytest.approx(F.explained_share(Y, Xc[cell], G), rel=1e-10)
    assert Ce.cell_share(count, Xc, sums, Y.T @ Y) == pytest.approx(F.explained_share(Y, Xc[cell]), rel=1e-10)
