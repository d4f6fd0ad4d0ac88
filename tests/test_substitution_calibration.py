"""Bias of Â and the calibrated kernel U (App. B): the vectorized corpus pass against a per-position loop,
closed-form hand cases for the bias table, and IPF recovering a kernel that reproduces P."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mfpipe.experiments.substitution.calibration import (
    bias_table,
    calibrate,
    corpus_pass,
    window_batches,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: intra-op threads only add overhead

VOCAB, N, BOS = 30, 8, 29


def luts(n=N, vocab=VOCAB, bos=BOS, tracked=None):
    """Tracked types are ids 0..n-1 (rank = id) unless given; everything else (BOS at positions >= 1 too) is
    `<other>`."""
    tracked = list(range(n)) if tracked is None else list(tracked)
    key = np.full(vocab, n + 1, dtype=np.int64)
    query = np.full(vocab, -1, dtype=np.int64)
    for r, t in enumerate(tracked):
        key[t] = r
        query[t] = r
    return {"key_lut": key, "query_lut": query, "n": n, "bos_id": bos}


def random_windows(n_windows, T, seed, vocab=VOCAB, bos=BOS):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1)  # Zipf-ish: tracked ids repeat within a window, untracked ones occur
    toks = rng.choice(vocab, size=(n_windows, T), p=p / p.sum())
    toks[:, 0] = bos
    return toks.astype(np.int32)


def slow_pass(W: np.ndarray, tokens: np.ndarray, lut) -> dict[str, np.ndarray]:
    """The corpus pass, one query position at a time (the loop of Alg. sinkhorn)."""
    H, n, K = W.shape
    Q = np.zeros((H, n, K))
    NX = np.zeros((H, n))
    inv = np.zeros((H, n))
    m = np.zeros(n, dtype=np.int64)
    for win in tokens:
        buckets = [n] + [int(lut["key_lut"][t]) for t in win[1:]]
        for j in range(1, len(win)):
            s = int(lut["query_lut"][win[j]])
            if s < 0:
                continue
            counts = np.zeros(K)
            for k in range(j + 1):
                counts[buckets[k]] += 1
            num = counts[None, :] * W[:, s, :]  # [H, K]
            nx = num.sum(-1)
            if not (np.all(np.isfinite(nx)) and np.all(nx > 0)):
                continue
            Q[:, s] += num / nx[:, None]
            NX[:, s] += nx
            inv[:, s] += 1.0 / nx
            m[s] += 1
    return {"Q_sum": Q, "NX_sum": NX, "inv_NX_sum": inv, "m": m}


def counts_from_windows(tokens, lut):
    """Model-free nbar [N, K], C [N, K], n_s [N] by the same per-position loop."""
    n = lut["n"]
    K = n + 2
    nsum = np.zeros((n, K))
    C = np.zeros((n, K), dtype=np.int64)
    qc = np.zeros(n, dtype=np.int64)
    for win in tokens:
        buckets = [n] + [int(lut["key_lut"][t]) for t in win[1:]]
        for j in range(1, len(win)):
            s = int(lut["query_lut"][win[j]])
            if s < 0:
                continue
            c = np.bincount(buckets[: j + 1], minlength=K)
            nsum[s] += c
            C[s] += c > 0
            qc[s] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        nbar = nsum / qc[:, None]
    return nbar, C, qc


def test_pass_equals_per_position_loop():
    tokens = random_windows(7, 13, seed=1)
    lut = luts()
    rng = np.random.default_rng(2)
    W = rng.gamma(0.7, 1.0, size=(3, N, N + 2))
    W[rng.random(W.shape) < 0.2] = 0.0  # off-support cells
    W[:, 5] = np.nan  # a type never seen as a query: its queries are not valid
    W[:, 6, :] = 0.0  # a row with no mass: invalid too
    W[1, 2, :] = 0.0  # invalid in one head -> not valid in any head (pair_kernel's definition)
    got = corpus_pass(torch.from_numpy(W), window_batches(tokens, lut, batch_size=3), max_elements=3 * 13 * 13 * 2)
    want = slow_pass(W, tokens, lut)
    for k, v in want.items():
        np.testing.assert_allclose(getattr(got, k).numpy(), v, rtol=0, atol=1e-10, err_msg=k)
    assert got.m[5] == 0 and got.m[6] == 0 and got.m[2] == 0 and int(got.m.sum()) > 20
    # every row with queries is a probability vector: sum_t Q_st = 1
    Q = got.Q.numpy()
    rows = got.m.numpy() > 0
    np.testing.assert_allclose(Q[:, rows].sum(-1), 1.0, atol=1e-12)
    assert np.all(np.isnan(Q[:, ~rows]))
    # float32 pair weights (the faster option) agree to float32 precision; the sums stay float64
    f32 = corpus_pass(torch.from_numpy(W).float(), window_batches(tokens, lut, batch_size=7))
    assert f32.Q_sum.dtype == torch.float64 and torch.equal(f32.m, got.m)
    np.testing.assert_allclose(f32.Q_sum.numpy(), want["Q_sum"], rtol=1e-5, atol=1e-6)
    # numpy input and a different batching give the same sums
    again = corpus_pass(W, window_batches([tokens[:4], tokens[4:]], lut, batch_size=2))
    np.testing.assert_allclose(again.Q_sum.numpy(), got.Q_sum.numpy(), atol=1e-12)


def test_hand_case_query_plus_bos_is_exact():
    """Windows [BOS, s]: every context holds its query's own type once and BOS once, so N_X = W_ss + W_sb =
    P_ss + P_sb = 1 and Â = P exactly, however the measured attention varies: ratio 1, E_s[N_X] = 1."""
    toks = np.array([[BOS, 0], [BOS, 0], [BOS, 1], [BOS, 0], [BOS, 1]], dtype=np.int32)
    lut = luts(n=2)
    # measured attention of each context on (s, bos): varies from context to context
    att = {0: [0.2, 0.5, 0.8], 1: [0.1, 0.7]}
    P = np.zeros((1, 2, 4))
    for s, a in att.items():
        P[0, s, s] = np.mean(a)
        P[0, s, 2] = 1 - np.mean(a)
    nbar, C, qc = counts_from_windows(toks, lut)
    assert np.all(nbar[[0, 1], [0, 1]] == 1) and np.all(nbar[:, 2] == 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        W = np.where(nbar > 0, P[0] / nbar, 0.0)[None]
    s = corpus_pass(W, window_batches(toks, lut))
    np.testing.assert_allclose(s.Q.numpy(), P, atol=1e-15)
    t = bias_table([s], P[None], nbar, C, qc, min_count=1)
    assert list(t["layer"]) == ["0", "all"]
    r = t.iloc[0]
    assert r["E_NX"] == pytest.approx(1.0, abs=1e-15) and r["E_inv_NX"] == pytest.approx(1.0, abs=1e-15)
    assert r["ratio"] == pytest.approx(1.0, abs=1e-15) and r["within_20pct"] == 1.0
    assert r["bos_ratio"] == pytest.approx(1.0, abs=1e-15) and np.isnan(r["other_ratio"])
    assert r["n_cells"] == 2 and r["E_nt"] == 1.0


def test_hand_case_repeated_type_closed_form():
    """Windows [BOS, s, s]: contexts {bos, s} and {bos, s, s}. With measured A_ss = a1, a2 (totals over the copies),
    P_ss = (a1 + a2)/2, nbar_ss = 1.5, W = (P_ss / 1.5, 1 - P_ss), and the closed form
    E_s[Â_ss] = (W_ss/(W_ss + W_sb) + 2 W_ss/(2 W_ss + W_sb)) / 2, N_X = W_ss + W_sb and 2 W_ss + W_sb."""
    toks = np.array([[BOS, 3, 3]] * 4, dtype=np.int32)
    lut = luts(n=4)
    a1, a2 = 0.3, 0.6
    P = np.zeros((1, 4, 6))
    P[0, 3, 3] = (a1 + a2) / 2
    P[0, 3, 4] = 1 - P[0, 3, 3]
    nbar, C, qc = counts_from_windows(toks, lut)
    assert nbar[3, 3] == 1.5 and C[3, 3] == 8 and qc[3] == 8
    with np.errstate(invalid="ignore", divide="ignore"):
        W = np.where(nbar > 0, P[0] / nbar, 0.0)[None]
    w_ss, w_sb = P[0, 3, 3] / 1.5, 1 - P[0, 3, 3]
    q_ss = (w_ss / (w_ss + w_sb) + 2 * w_ss / (2 * w_ss + w_sb)) / 2
    nx = ((w_ss + w_sb) + (2 * w_ss + w_sb)) / 2
    inv = (1 / (w_ss + w_sb) + 1 / (2 * w_ss + w_sb)) / 2
    s = corpus_pass(W, window_batches(toks, lut))
    assert s.Q.numpy()[0, 3, 3] == pytest.approx(q_ss, abs=1e-15)
    t = bias_table({0: s}, P[None], nbar, C, qc, min_count=1).iloc[0]
    assert t["ratio"] == pytest.approx(q_ss / P[0, 3, 3], abs=1e-14)
    assert t["ratio"] < 1  # the repeated type is under-predicted (eq:twoterm's covariance term) ...
    assert t["bos_ratio"] == pytest.approx((1 - q_ss) / P[0, 3, 4], abs=1e-14)
    assert t["bos_ratio"] > 1  # ... and the BOS sink over-predicted: P-weighted biases cancel (eq:sumzero)
    assert P[0, 3, 3] * (1 - t["ratio"]) + P[0, 3, 4] * (1 - t["bos_ratio"]) == pytest.approx(0, abs=1e-14)
    assert t["E_NX"] == pytest.approx(nx, abs=1e-15) and t["E_inv_NX"] == pytest.approx(inv, abs=1e-14)
    assert t["E_nt"] == pytest.approx(1.5, abs=1e-15)  # nbar * n_s / C
    assert t["n_cells"] == 1 and t["within_20pct"] == float(abs(t["ratio"] - 1) <= 0.2)
    # min_count: a cell below it is not well-sampled and leaves the table
    assert bias_table([s], P[None], nbar, C, qc, min_count=9).iloc[0]["n_cells"] == 0


def test_bias_table_against_cellwise_reference():
    tokens = random_windows(12, 16, seed=5)
    lut = luts()
    rng = np.random.default_rng(6)
    L, H = 2, 2
    nbar, C, qc = counts_from_windows(tokens, lut)
    P = rng.dirichlet(np.ones(N + 2), size=(L, H, N)) * (C > 0)[None, None]
    P /= P.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        W = np.where(C > 0, P / np.where(C > 0, nbar, 1.0), 0.0)
    batches = window_batches(tokens, lut, batch_size=5)
    passes = [corpus_pass(W[l], batches) for l in range(L)]
    t = bias_table(passes, P, nbar, C, qc, min_count=3)
    well = C >= 3
    ratios, bos, inside = [], [], []
    for l in range(L):
        Q = passes[l].Q.numpy()
        for h in range(H):
            for s in range(N):
                for tt in range(N + 2):
                    if well[s, tt] and P[l, h, s, tt] > 0 and qc[s] > 0:
                        (ratios if tt < N else bos if tt == N else inside).append(Q[h, s, tt] / P[l, h, s, tt])
    r = t.set_index("layer").loc["all"]
    assert r["ratio"] == pytest.approx(np.mean(ratios), abs=1e-12)
    assert r["within_20pct"] == pytest.approx(np.mean(np.abs(np.array(ratios) - 1) <= 0.2), abs=1e-12)
    assert r["bos_ratio"] == pytest.approx(np.mean(bos), abs=1e-12)
    assert r["other_ratio"] == pytest.approx(np.mean(inside), abs=1e-12)
    assert r["n_cells"] == len(ratios)
    ent = [nbar[s, tt] * qc[s] / C[s, tt] for s in range(N) for tt in range(N) if well[s, tt]]
    assert r["E_nt"] == pytest.approx(np.mean(ent), abs=1e-12)
    # E_s[N_X] ~ 1 is the consistency check on P and nbar (exactly 1 in expectation when nothing is masked)
    nx = np.mean([passes[l].NX_sum.numpy().sum() / (H * passes[l].m.numpy().sum()) for l in range(L)])
    assert r["E_NX"] == pytest.approx(nx, abs=1e-12) and abs(r["E_NX"] - 1) < 0.05


def test_ipf_recovers_a_kernel_that_reproduces_P():
    """P generated from a ground-truth U* through the same renormalisation (so a fixed point exists): IPF from
    W = P / nbar drives the residual down and reproduces P."""
    tokens = random_windows(16, 14, seed=8)
    lut = luts()
    rng = np.random.default_rng(9)
    H = 2
    U_true = rng.lognormal(0.0, 1.0, size=(H, N, N + 2))
    batches = window_batches(tokens, lut, batch_size=8)
    truth = corpus_pass(U_true, batches)
    P = truth.Q.numpy()
    nbar, C, qc = counts_from_windows(tokens, lut)
    assert np.array_equal(truth.m.numpy(), qc)
    rows = qc > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        W = np.where(C > 0, P / np.where(C > 0, nbar, 1.0), 0.0)
    W[:, ~rows] = np.nan
    U, table = calibrate(W, P, batches, iterations=5, layer=3)
    assert list(table["iteration"]) == [0, 1, 2, 3, 4, 5] and set(table["layer"]) == {3}
    # iteration 0 is W's own residual
    w_pass = corpus_pass(W, batches)
    d0 = np.abs(w_pass.Q.numpy() - P)[:, rows][(W[:, rows] > 0)]
    assert table["max_abs"].iloc[0] == pytest.approx(d0.max(), abs=1e-14)
    assert table["max_abs"].iloc[0] > 1e-2
    assert table["max_abs"].iloc[5] < 0.05 * table["max_abs"].iloc[0]
    assert table["median_rel"].iloc[5] < 0.05 * table["median_rel"].iloc[0]
    # the returned U's residual is the last row
    q = corpus_pass(U, batches).Q.numpy()
    assert np.abs(q - P)[:, rows][(U.numpy()[:, rows] > 0)].max() == pytest.approx(table["max_abs"].iloc[5], abs=1e-14)
    # W's zeros stay zero, NaN rows stay NaN
    assert np.all(U.numpy()[W == 0] == 0) and np.all(np.isnan(U.numpy()[:, ~rows]))
    # run to convergence: Q = P to 1e-6, and the loop stops at eps
    U2, t2 = calibrate(W, P, batches, iterations=300, eps=1e-8)
    assert t2["max_abs"].iloc[-1] < 1e-8 and len(t2) < 301
    q2 = corpus_pass(U2, batches).Q.numpy()
    np.testing.assert_allclose(q2[:, rows], P[:, rows], atol=1e-6)
    # initial= reuses a pass of W (same table), evaluate_final=False skips the last pass
    _, t3 = calibrate(W, P, batches, iterations=2, initial=w_pass, evaluate_final=False)
    assert list(t3["iteration"]) == [0, 1]
    np.testing.assert_allclose(t3["max_abs"], table["max_abs"].iloc[:2], atol=1e-14)
    # damping alpha < 1 also converges, more slowly
    _, t4 = calibrate(W, P, batches, iterations=5, alpha=0.5)
    assert t4["max_abs"].iloc[-1] < table["max_abs"].iloc[0] and t4["max_abs"].iloc[-1] > table["max_abs"].iloc[-1]


# ------------------------------------------------------------------------------------------------ the job
def test_calibrate_job_end_to_end(tmp_path):
    """calibrate_kernel on a store whose P comes from a known U*: the bias table's layers agree with the library on
    the store's own W, the residual falls, U is stored with the store's coordinates and provenance, and the reader
    refuses a foreign store; shards that are not the store's are refused."""
    from pathlib import Path

    import pandas as pd
    from synthetic_stats import (
        NamedList,
        make_store,
        run_job,
        tracked_set,
        windows,
        write_corpus,
    )

    from mfpipe.meanfield.calibrated import load_calibrated
    from mfpipe.stats import ProvenanceError, open_stats

    tok = windows(30, seed=3)
    ts = tracked_set(tok)
    rng = np.random.default_rng(5)
    U_true = rng.lognormal(0, 1.0, size=(2, 2, ts.n, ts.n + 2))
    store = make_store(tmp_path / "stats.zarr", tok, ts, U_true, revision="step64")
    shards, tracked_json = write_corpus(tmp_path / "corpus", tok, ts)
    out = tmp_path / "cal"
    outputs = NamedList(kernel=str(out / "calibrated.zarr"), bias=str(out / "bias.csv"), bias_md=str(out / "bias.md"),
                        residuals=str(out / "residuals.csv"), residuals_md=str(out / "residuals.md"))
    params = NamedList(model="synth", revision="step64", min_count=1, iterations=5, alpha=1.0, batch_size=4)
    run_job("experiments.substitution", "calibrate_kernel",
            input=NamedList(stats=str(store), shards=[str(p) for p in shards], tracked=str(tracked_json)),
            output=outputs, params=params, log=[str(tmp_path / "cal.log")])
    for p in outputs:
        assert Path(p).exists(), p
    st = open_stats(store)
    bias = pd.read_csv(outputs.bias)
    assert list(bias["layer"].astype(str)) == ["0", "1", "all"] and set(bias["model"]) == {"synth"}
    batches = window_batches(tok, ts, batch_size=4)
    W0 = st.W(min_count=1, layer=0).values
    want = bias_table([corpus_pass(W0, batches)], st.P(layer=0).values[None], st.nbar().values,
                      st.context_count().values, st.query_count().values, min_count=1).iloc[0]
    got = bias.iloc[0]
    for col in ("E_NX", "E_inv_NX", "E_nt", "ratio", "within_20pct", "bos_ratio", "other_ratio", "n_cells"):
        assert got[col] == pytest.approx(want[col], rel=1e-9, abs=1e-12), col
    assert got["ratio"] != pytest.approx(1.0, abs=1e-3)  # W is biased on these windows: something to calibrate
    res = pd.read_csv(outputs.residuals)
    assert list(res["iteration"]) == [0, 1, 2, 3, 4, 5] * 2
    for _, g in res.groupby("layer"):
        assert g["max_abs"].iloc[-1] < 0.1 * g["max_abs"].iloc[0]
    assert "| 1 | max \\|Q-P\\| |" in Path(outputs.residuals_md).read_text()
    assert "E_NX" in Path(outputs.bias_md).read_text()

    U = load_calibrated(outputs.kernel, expect={"model": "synth", "revision": "step64",
                                                "tracked_fingerprint": ts.fingerprint})
    W = st.W(min_count=1)
    assert U.dims == W.dims and U.shape == W.shape and U.dtype == np.float32
    assert not U.variable._in_memory  # read from the store a layer at a time by kernel_from_store, never whole
    for c in ("layer", "head", "query", "key", "query_str", "key_str", "query_token_id", "key_token_id"):
        np.testing.assert_array_equal(U[c].values, W[c].values, err_msg=c)
    # U is what calibrate() makes of this layer's W and P (float32 storage)
    U1, _ = calibrate(W.isel(layer=1).values, st.P(layer=1).values, batches, iterations=5)
    np.testing.assert_allclose(U.isel(layer=1).values, U1.numpy(), rtol=1e-6, equal_nan=True)
    assert np.array_equal(U.values == 0, W.values == 0)
    assert U.attrs["kind"] == "calibrated"
    with pytest.raises(ProvenanceError, match="revision"):
        load_calibrated(outputs.kernel, expect={"revision": "step128"})
    # U stands in for this store's W: paired with the statistics of another corpus (or half) it is refused, naming it
    # (before stop 81 only model, revision and tracked set were checked, by the caller)
    from mfpipe.meanfield.calibrated import calibrated_dataset, write_calibrated
    from mfpipe.meanfield.kernel import kernel_from_store

    assert kernel_from_store(st, ts, calibrated=U).W.shape[0] == 2
    other = write_calibrated(calibrated_dataset(U.values, st, {"corpus_fingerprint": "OTHER"}), tmp_path / "o.zarr")
    with pytest.raises(ProvenanceError, match="another corpus fingerprint \('OTHER'\)"):
        kernel_from_store(st, ts, calibrated=load_calibrated(other))
    with pytest.raises(ValueError, match="not a calibrated kernel store"):
        load_calibrated(store)

    # shards that are not the ones the store was measured on are refused
    with pytest.raises(SystemExit):
        run_job("experiments.substitution", "calibrate_kernel",
                input=NamedList(stats=str(store), shards=[str(p) for p in shards[:-1]], tracked=str(tracked_json)),
                output=outputs, params=params, log=[str(tmp_path / "bad.log")])
    assert "calibrate on the shards of the half the store was computed from" in Path(tmp_path / "bad.log").read_text()
