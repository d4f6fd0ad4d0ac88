"""Kernel dynamics (Sec. 5.3, App. N): CKA from rank-r factors against the textbook formula, row spread by hand."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mfpipe.experiments.substitution.kernel_dynamics import (
    adjacent_cka,
    cka_matrix,
    cka_per_head,
    kernel_factors,
    linear_cka,
    masked_kernel,
    row_spread,
    support_fingerprint,
    support_mask,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: intra-op threads only add overhead


def textbook_cka(X: np.ndarray, Y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al. 2019) on the full matrices, samples in rows, centred over samples."""
    Xc = X - X.mean(0, keepdims=True)
    Yc = Y - Y.mean(0, keepdims=True)
    return float(np.linalg.norm(Yc.T @ Xc) ** 2 / (np.linalg.norm(Xc.T @ Xc) * np.linalg.norm(Yc.T @ Yc)))


def random_kernel(rng, H=3, N=12, K=14, nan_row=True):
    W = rng.gamma(1.0, 1.0, size=(H, N, K))
    if nan_row:
        W[:, 4] = np.nan  # a type never seen as a query
    return W


def test_support_mask_excludes_bos_and_other():
    C = np.array([[25, 3, 20, 40, 40], [0, 19, 20, 5, 30], [20, 20, 20, 20, 20]])
    m = support_mask(C, n_tracked=3, min_count=20)
    assert m.tolist() == [[True, False, True, False, False], [False, False, True, False, False],
                          [True, True, True, False, False]]
    assert support_fingerprint(m) == support_fingerprint(m.copy())
    m2 = m.copy()
    m2[0, 0] = False
    assert support_fingerprint(m2) != support_fingerprint(m)


def test_full_rank_cka_equals_textbook():
    rng = np.random.default_rng(0)
    Wa, Wb = random_kernel(rng), random_kernel(rng)
    C = rng.integers(0, 60, size=Wa.shape[1:])
    mask = support_mask(C, n_tracked=Wa.shape[1] - 2)
    N = Wa.shape[1]
    Fa, Fb = kernel_factors(Wa, mask, rank=N), kernel_factors(Wb, mask, rank=N)
    assert Fa.shape == (3, N, N)
    got = linear_cka(Fa, Fb)
    Xa, Xb = masked_kernel(Wa, mask), masked_kernel(Wb, mask)
    # masked_kernel: off-support and NaN rows are 0; the BOS/other columns (K-2, K-1) are off-support
    assert np.all(Xa[:, 4] == 0) and np.all(Xa[:, :, -2:] == 0) and np.all(Xa[:, ~mask] == 0)
    want = np.array([textbook_cka(Xa[h], Xb[h]) for h in range(3)])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    # and the matrix: symmetric, unit diagonal, off-diagonal = the head mean
    M = cka_matrix([Fa[None], Fb[None], Fa[None]])
    assert M.shape == (3, 3)
    np.testing.assert_allclose(M, M.T, atol=1e-14)
    np.testing.assert_allclose(np.diag(M), 1.0, atol=1e-12)
    np.testing.assert_allclose(M[0, 1], want.mean(), atol=1e-10)
    np.testing.assert_allclose(M[0, 2], 1.0, atol=1e-12)
    np.testing.assert_allclose(adjacent_cka(M), [M[0, 1], M[1, 2]])


def test_cka_is_scale_invariant_and_below_one():
    rng = np.random.default_rng(1)
    W = random_kernel(rng, nan_row=False)
    mask = np.ones(W.shape[1:], dtype=bool)
    F = kernel_factors(W, mask, rank=8)
    F3 = kernel_factors(3.7 * W, mask, rank=8)
    np.testing.assert_allclose(linear_cka(F, F3), 1.0, atol=1e-12)
    # adding a constant to every row (a column offset) is removed by the column centring
    Fc = kernel_factors(W + rng.normal(size=W.shape[2])[None, None, :] ** 2, mask, rank=8)
    np.testing.assert_allclose(linear_cka(F, Fc), 1.0, atol=1e-10)
    Fo = kernel_factors(random_kernel(rng, nan_row=False), mask, rank=8)
    assert np.all(linear_cka(F, Fo) < 0.99)


def test_rank_r_approximant_close_to_exact():
    rng = np.random.default_rng(2)
    H, N, K, r = 2, 150, 152, 10
    mask = np.ones((N, K), dtype=bool)

    U, V = rng.normal(size=(H, N, r)), rng.normal(size=(H, r, K)) * np.linspace(3, 1, r)[None, :, None]
    U2, V2 = rng.normal(size=(H, N, r)), rng.normal(size=(H, r, K))
    Wa = U @ V + 0.01 * rng.normal(size=(H, N, K))  # rank r plus noise
    Wb = (U + 0.5 * U2) @ (V + 0.5 * V2) + 0.01 * rng.normal(size=(H, N, K))  # another rank-r kernel, related
    exact = np.array([textbook_cka(Wa[h], Wb[h]) for h in range(H)])
    approx = linear_cka(kernel_factors(Wa, mask, rank=r), kernel_factors(Wb, mask, rank=r))
    full = linear_cka(kernel_factors(Wa, mask, rank=N), kernel_factors(Wb, mask, rank=N))
    np.testing.assert_allclose(full, exact, atol=1e-10)
    assert np.max(np.abs(approx - exact)) < 1e-3
    # a rank far below the signal's rank is visibly off (the approximant is doing something)
    assert np.max(np.abs(linear_cka(kernel_factors(Wa, mask, rank=1), kernel_factors(Wb, mask, rank=1)) - exact)) > 1e-3


def test_cka_per_head_and_per_layer():
    rng = np.random.default_rng(3)
    L, H, N = 2, 3, 9
    mask = np.ones((N, N + 2), dtype=bool)
    revs = [np.stack([kernel_factors(random_kernel(rng, H, N, N + 2, False), mask, rank=N) for _ in range(L)])
            for _ in range(4)]
    c = cka_per_head(revs)
    assert c.shape == (4, 4, L, H)
    np.testing.assert_allclose(c[1, 3, 1, 2], linear_cka(revs[1][1, 2], revs[3][1, 2]), atol=1e-14)
    per_layer = cka_matrix(revs, per_layer=True)
    assert per_layer.shape == (L, 4, 4)
    np.testing.assert_allclose(per_layer[1], c[:, :, 1].mean(-1))
    np.testing.assert_allclose(cka_matrix(revs), c.reshape(4, 4, -1).mean(-1))
    # an all-zero head is left out of the mean, not counted as 0 or 1
    z = [r.copy() for r in revs]
    z[0][0, 0] = 0.0
    m = cka_matrix(z)
    keep = np.ones((L, H), dtype=bool)
    keep[0, 0] = False
    np.testing.assert_allclose(m[0, 1], cka_per_head(z)[0, 1][keep].mean())
    assert np.isnan(cka_per_head(z)[0, 1, 0, 0])


def test_row_spread_hand_case():
    # one head, 3 query types, K = 5 (3 tracked + bos + other)
    W = np.zeros((1, 3, 5))
    W[0, 0] = [1.0, np.e, np.e**2, 9.0, 9.0]  # logs 0,1,2: std sqrt(2/3); bos/other ignored
    W[0, 1] = [np.e**3, 1.0, 0.0, 1.0, 1.0]  # logs 3, 0 (the 0 entry is skipped): std 1.5
    W[0, 2] = [5.0, 0.0, 0.0, 1.0, 1.0]  # one entry: not counted
    mask = support_mask(np.full((3, 5), 100), n_tracked=3)
    got = row_spread(W, mask)
    np.testing.assert_allclose(got, [(np.sqrt(2 / 3) + 1.5) / 2], atol=1e-12)
    # off-support entries do not count: mask the entry e^2 of row 0 -> logs 0,1: std 0.5
    mask[0, 2] = False
    np.testing.assert_allclose(row_spread(W, mask), [(0.5 + 1.5) / 2], atol=1e-12)
    # NaN rows are ignored; a head with no row of >= 2 entries is NaN
    W2 = np.full((2, 3, 5), np.nan)
    W2[0] = W[0]
    W2[1, :, :] = 0.0
    W2[1, 0, 0] = 1.0
    got = row_spread(W2, mask)
    np.testing.assert_allclose(got[0], 1.0, atol=1e-12)
    assert np.isnan(got[1])
    # a uniform row has spread 0 (fold-variation exp(0) = 1)
    assert row_spread(np.ones((1, 3, 5)), support_mask(np.full((3, 5), 100), 3))[0] == 0.0


# ------------------------------------------------------------------------------------------------ figures
def _lines(ax):
    return [(l.get_xdata(), l.get_ydata(), l) for l in ax.get_lines() if l.get_linestyle() != ":"]


def test_cka_figure_plots_its_inputs(tmp_path, monkeypatch):
    from mfpipe.experiments.substitution import figures as sweep_figures

    captured = {}
    real = sweep_figures.save_figure

    def spy(fig, pdf, png, dpi=150):
        captured["fig"] = fig
        real(fig, pdf, png, dpi=dpi)

    monkeypatch.setattr(sweep_figures, "save_figure", spy)
    steps = [0, 1, 2, 4, 64, 1000]
    rng = np.random.default_rng(0)
    M = rng.uniform(0.5, 1.0, size=(6, 6))
    M = (M + M.T) / 2
    np.fill_diagonal(M, 1.0)
    adj = adjacent_cka(M)
    pdf, png = sweep_figures.cka_figure(M, adj, steps, tmp_path / "cka", window=(2, 64), title="t")
    assert pdf.stat().st_size > 0 and png.stat().st_size > 0 and pdf.suffix == ".pdf" and png.suffix == ".png"
    heat, curve = captured["fig"].axes[:2]
    np.testing.assert_array_equal(heat.get_images()[0].get_array(), M)
    (x, y, _), = _lines(curve)
    np.testing.assert_array_equal(x, steps[1:])
    np.testing.assert_array_equal(y, adj)
    assert curve.get_xscale() == "symlog"
    span = [p for p in curve.patches if p.get_label() == "induction window"]
    assert len(span) == 1
    assert span[0].get_x() == 2 and span[0].get_x() + span[0].get_width() == 64
    with pytest.raises(ValueError):
        sweep_figures.cka_figure(M, adj[:-1], steps, tmp_path / "bad")


def test_spread_figure_plots_its_inputs(tmp_path, monkeypatch):
    import pandas as pd

    from mfpipe.experiments.substitution import figures as sweep_figures

    captured = {}
    real = sweep_figures.save_figure
    monkeypatch.setattr(sweep_figures, "save_figure",
                        lambda fig, pdf, png, dpi=150: (captured.setdefault("fig", fig), real(fig, pdf, png, dpi=dpi)))
    rng = np.random.default_rng(1)
    steps = [0, 16, 256, 4096]
    rows = [{"revision": f"step{s}", "step": s, "layer": l, "head": h, "spread": float(rng.uniform(0.2, 2.0))}
            for s in steps for l in range(2) for h in range(3)]
    df = pd.DataFrame(rows)
    csv = tmp_path / "spread.csv"
    df.to_csv(csv, index=False)
    sweep_figures.spread_figure(csv, tmp_path / "spread.pdf", png=tmp_path / "spread.png")
    assert (tmp_path / "spread.pdf").stat().st_size > 0 and (tmp_path / "spread.png").stat().st_size > 0
    left, right = captured["fig"].axes[:2]
    (x, y, _), = _lines(left)
    fold = np.exp(df.pivot_table(index="step", columns=["layer", "head"], values="spread"))
    np.testing.assert_array_equal(x, steps)
    np.testing.assert_allclose(y, fold.mean(axis=1).to_numpy(), rtol=1e-12)
    band = left.collections[0].get_paths()[0].vertices[:, 1]
    assert np.isclose(band.min(), fold.quantile(0.25, axis=1).min()) and np.isclose(band.max(),
                                                                                 fold.quantile(0.75, axis=1).max())
    heads = {l.get_gid(): (l.get_xdata(), l.get_ydata(), l.get_color()) for _, _, l in _lines(right)}
    assert len(heads) == 6
    for (layer, head), col in fold.items():
        hx, hy, _ = heads[f"L{layer}H{head}"]
        np.testing.assert_array_equal(hx, steps)
        np.testing.assert_allclose(hy, col.to_numpy(), rtol=1e-12)
    # coloured by layer: one colour per layer
    assert heads["L0H0"][2] == heads["L0H2"][2] != heads["L1H0"][2]


# ------------------------------------------------------------------------------------------------ the jobs
def _revision_stores(tmp_path, n_revs=3, tracked_shift=0):
    from synthetic_stats import make_store, tracked_set, windows

    tok = windows()
    ts = tracked_set(tok, shift=tracked_shift)
    rng = np.random.default_rng(4)
    U = rng.lognormal(0, 0.3, size=(2, 3, ts.n, ts.n + 2))
    paths = []
    for r in range(n_revs):
        U = U * rng.lognormal(0, 0.4 * r, size=U.shape)  # the kernel drifts from checkpoint to checkpoint
        paths.append(make_store(tmp_path / "stats" / f"step{2 ** (4 * r) if r else 0}" / "stats.zarr", tok, ts, U,
                                revision=f"step{2 ** (4 * r) if r else 0}"))
    return paths


def test_kernel_jobs_end_to_end(tmp_path):
    """kernel_revision per checkpoint, then kernel_dynamics: the CKA table equals the textbook CKA of the stores'
    own W (full rank), the spread table equals row_spread of W, and foreign kernels are refused naming the file."""
    import json

    import pandas as pd
    from synthetic_stats import NamedList, run_job

    from mfpipe.experiments.substitution.kernel_dynamics import open_kernel
    from mfpipe.stats import open_stats

    stores = _revision_stores(tmp_path)
    revs = ["step0", "step16", "step256"]
    steps = [0, 16, 256]
    kernels = []
    for rev, store in zip(revs, stores):
        out = tmp_path / "kernels" / rev / "kernel.zarr"
        run_job("experiments.substitution", "kernel_revision", input=NamedList(stats=str(store)),
                output=NamedList(str(out)), params=NamedList(model="synth", revision=rev, min_count=3, rank=96),
                log=[str(tmp_path / f"{rev}.log")])
        kernels.append(str(out))
    st = open_stats(stores[1])
    k = open_kernel(kernels[1])
    N = st.n
    assert k["factor"].dims == ("layer", "head", "query", "rank") and k.sizes["rank"] == N  # rank min(96, N)
    for key in ("model", "revision", "tracked_fingerprint", "corpus_fingerprint", "n_tracked", "mfpipe_version",
                "stats_mfpipe_version", "support_fingerprint"):
        assert key in k.attrs, key
    assert k.attrs["revision"] == "step16" and k.attrs["tracked_fingerprint"] == st.attrs["tracked_fingerprint"]
    mask = support_mask(st.context_count().values, N, 3)
    assert int(k["support_size"]) == mask.sum() and 0 < mask.sum() < N * N
    np.testing.assert_allclose(k["rank_energy"].values, 1.0, atol=1e-5)  # full rank keeps everything
    W = [[open_stats(s).W(min_count=3, layer=l).values for l in range(2)] for s in stores]
    np.testing.assert_allclose(k["spread"].values, [row_spread(W[1][l], mask) for l in range(2)], rtol=1e-6)

    training = tmp_path / "training.json"
    training.write_text(json.dumps({"induction_curve": [{"step": s, "max_induction": v, "induction_loss": 1.0}
                                                        for s, v in zip([0, 8, 16, 64, 256], [0.0, 0.05, 0.5, 0.95, 1.0])]}))
    res = tmp_path / "dyn"
    outputs = NamedList(cka=str(res / "cka.csv"), adjacent=str(res / "adjacent.csv"), spread=str(res / "spread.csv"),
                        cka_pdf=str(res / "cka.pdf"), cka_png=str(res / "cka.png"), spread_pdf=str(res / "spread.pdf"),
                        spread_png=str(res / "spread.png"))
    run_job("experiments.substitution", "kernel_dynamics", input=NamedList(kernels=kernels, training=str(training)),
            output=outputs, params=NamedList(model="synth", revisions=revs, steps=steps, window=None),
            log=[str(tmp_path / "dyn.log")])
    for p in outputs:
        assert Path(p).stat().st_size > 0, p
    cka = pd.read_csv(outputs.cka)
    assert len(cka) == 9 and set(cka.columns) == {"rev_a", "rev_b", "step_a", "step_b", "cka"}
    for _, row in cka.iterrows():
        a, b = revs.index(row["rev_a"]), revs.index(row["rev_b"])
        want = np.mean([textbook_cka(masked_kernel(W[a][l], mask)[h], masked_kernel(W[b][l], mask)[h])
                        for l in range(2) for h in range(3)])
        assert row["cka"] == pytest.approx(want, abs=1e-5), (a, b)
    adj = pd.read_csv(outputs.adjacent)
    assert list(adj["rev_b"]) == revs[1:] and list(adj["step_a"]) == steps[:2]
    c = cka.set_index(["rev_a", "rev_b"])["cka"]
    np.testing.assert_allclose(adj["cka"], [c[("step0", "step16")], c[("step16", "step256")]])
    assert adj["cka"].iloc[1] < 0.99  # the synthetic kernel moved
    sp = pd.read_csv(outputs.spread)
    assert len(sp) == 3 * 2 * 3 and list(sp.columns) == ["revision", "step", "layer", "head", "spread"]
    got = sp[(sp.revision == "step256") & (sp.layer == 1)].sort_values("head")["spread"].to_numpy()
    np.testing.assert_allclose(got, row_spread(W[2][1], mask), rtol=1e-6)
    assert "induction window (8.0, 64.0)" in Path(tmp_path / "dyn.log").read_text()

    # a kernel from another tracked set is refused, naming the file
    other = _revision_stores(tmp_path / "other", n_revs=1, tracked_shift=1)[0]
    foreign = tmp_path / "foreign" / "kernel.zarr"
    run_job("experiments.substitution", "kernel_revision", input=NamedList(stats=str(other)),
            output=NamedList(str(foreign)), params=NamedList(model="synth", revision="step0", min_count=3, rank=96),
            log=[str(tmp_path / "f.log")])
    with pytest.raises(SystemExit):
        run_job("experiments.substitution", "kernel_dynamics", input=NamedList(kernels=[kernels[0], str(foreign)]),
                output=outputs, params=NamedList(model="synth", revisions=["step0", "step0"], steps=[0, 1],
                                                 window=[1, 2]), log=[str(tmp_path / "bad.log")])
    text = Path(tmp_path / "bad.log").read_text()
    assert f"kernel store {foreign} has tracked_fingerprint" in text
    # a store listed out of revision order is refused too
    with pytest.raises(SystemExit):
        run_job("experiments.substitution", "kernel_dynamics", input=NamedList(kernels=kernels[::-1]), output=outputs,
                params=NamedList(model="synth", revisions=revs, steps=steps, window=None),
                log=[str(tmp_path / "order.log")])
    assert "is for revision 'step256', expected 'step0'" in Path(tmp_path / "order.log").read_text()
