"""The rollout glue (mfpipe.experiments.rollout) and its figures on real statistics stores of tiny random models:
provenance refusal, Table 1 against independent references (an HF-only slow rollout, the plain ``[BOS, t]``
forward), standard errors, coverage rows, the cross-corpus diagonal, the error accounting tables against
per-occurrence references, pinning, types absent from a statistics half, and the figure files."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from figure_data import capture, image, lines, main_axes, tick_values
from rollout_reference import Ref, estimators_reference, forward_residuals
from stats_reference import BOS, tracked_for, zipf_windows
from tiny_models import make_tiny_model

from mfpipe.experiments.rollout import accounting as AC
from mfpipe.experiments.rollout import figures as F
from mfpipe.experiments.rollout import kernels as K
from mfpipe.experiments.rollout import metrics as M
from mfpipe.experiments.rollout import runs as RO
from mfpipe.experiments.rollout import tables as RT
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import (
    ProvenanceError,
    accumulate_shard,
    finalize,
    open_stats,
    write_store,
)
from mfpipe.stats import halves as S

N_WINDOWS = 24


def _store(model, adapter, tokens, tracked, path, half, corpus="zipf", fp="fp-zipf", name="tiny"):
    sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=8, device="cpu", progress=False)
    meta = {"model": name, "revision": "r1", "half": half, "corpus": corpus, "corpus_fingerprint": fp,
            "model_type": adapter.model_type}
    return write_store(finalize(sums, tracked, meta), path)


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox"])
def stores(request, tmp_path_factory):
    """stats / eval halves of a primary corpus and of a second corpus in which two tracked types never occur."""
    mt = request.param
    model = make_tiny_model(mt, seed=7)
    ad = get_adapter(model)
    root = tmp_path_factory.mktemp(f"stores-{mt}")
    st_tok = zipf_windows(N_WINDOWS, seed=1)
    tracked = tracked_for(st_tok)
    ev_tok = zipf_windows(N_WINDOWS, seed=2)
    # the second corpus: another Zipf law (another seed permutes the ranks) without tracked types 3 and 5
    x_st, x_ev = zipf_windows(N_WINDOWS, seed=11), zipf_windows(N_WINDOWS, seed=12)
    untracked = np.setdiff1d(np.arange(BOS), tracked.type_ids)[0]
    for tok in (x_st, x_ev):
        tok[np.isin(tok, tracked.type_ids[[3, 5]])] = untracked
    paths = {
        "stats": _store(model, ad, st_tok, tracked, root / "stats.zarr", "stats"),
        "eval": _store(model, ad, ev_tok, tracked, root / "eval.zarr", "eval"),
        "x/stats": _store(model, ad, x_st, tracked, root / "x" / "stats.zarr", "stats", "other", "fp-other"),
        "x/eval": _store(model, ad, x_ev, tracked, root / "x" / "eval.zarr", "eval", "other", "fp-other"),
    }
    other = tracked_for(ev_tok, n=tracked.n - 1)  # a different tracked set
    paths["eval_other_tracked"] = _store(model, ad, ev_tok, other, root / "eval_o.zarr", "eval")
    paths["eval_other_model"] = _store(model, ad, ev_tok, tracked, root / "eval_m.zarr", "eval", name="other-model")
    return mt, model, ad, paths, tracked


@pytest.fixture(scope="module")
def scores(stores):
    mt, model, ad, p, _ = stores
    return RO.run_rollouts(model, ad, p["stats"], p["eval"], seed=3, model_name="tiny", revision="r1")


# ------------------------------------------------------------------------------------------ provenance
def test_provenance_refusal(stores):
    mt, model, ad, p, _ = stores
    st, ev = S.open_pair(p["stats"], p["eval"], model="tiny", revision="r1")
    assert st.attrs["half"] == "stats" and ev.attrs["half"] == "eval"
    with pytest.raises(ProvenanceError, match="half"):
        S.open_pair(p["eval"], p["eval"])  # an eval half as statistics
    with pytest.raises(ProvenanceError, match="half"):
        S.open_pair(p["stats"], p["stats"])  # the statistics half as truth
    with pytest.raises(ProvenanceError, match="model"):
        S.open_pair(p["stats"], p["eval"], model="gpt2-small")
    with pytest.raises(ProvenanceError, match="revision"):
        S.open_pair(p["stats"], p["eval"], revision="main")
    with pytest.raises(ProvenanceError, match="n_tracked|tracked_fingerprint"):
        S.open_pair(p["stats"], p["eval_other_tracked"])
    with pytest.raises(ProvenanceError, match="model"):
        S.open_pair(p["stats"], p["eval_other_model"])
    with pytest.raises(ProvenanceError, match="corpus_fingerprint"):
        S.open_pair(p["stats"], p["x/eval"])  # truth of another corpus is only allowed in the cross matrix
    S.open_pair(p["stats"], p["x/eval"], same_corpus=False)
    other = get_adapter(make_tiny_model("gpt_neox" if mt == "gpt2" else "gpt2", seed=1))
    with pytest.raises(ProvenanceError, match="model_type"):
        S.check_model(other, st)
    with pytest.raises(ProvenanceError):
        RO.run_rollouts(model, ad, p["stats"], p["eval_other_tracked"], kernels=["mean_field"])


# ------------------------------------------------------------------------------------------- rollout
def test_scores_match_independent_references(stores, scores):
    """The mean_field rows are Alg. 1 with the stored P (an HF-only slow rollout from the embedding plus, for
    GPT-2, the position-count-weighted mean of wpe), the context_free rows the plain forward of [BOS, t]; both
    scored against the evaluation centroids."""
    mt, model, ad, p, _ = stores
    L = ad.n_layers
    assert set(scores["kernel"]) == set(RT.DEFAULT_KERNELS)
    assert len(scores) == len(RT.DEFAULT_KERNELS) * L * len(M.METRICS)
    assert sorted(scores["depth"].unique()) == list(range(1, L + 1))
    assert np.isfinite(scores["value"]).all()
    assert not scores["pinned"].any()
    st, ev = open_stats(p["stats"]), open_stats(p["eval"])
    ids = st.ds["query_token_id"].values
    bos_id = int(st.attrs["bos_id"])
    ref = Ref(model)
    with torch.no_grad():
        start = model.get_input_embeddings()(torch.as_tensor(ids)).numpy()
        if mt == "gpt2":
            pc = st.ds["position_count"].values.astype(np.float64)
            start = start + pc @ model.transformer.wpe.weight[: pc.size].numpy() / pc.sum()
    b = forward_residuals(ref, [[bos_id]])[:, 0, 0]
    types = S.eval_types(st, ev)
    truth = ev.centroids().values
    preds = {"mean_field": ref.rollout(st.P().values, start, b),
             "context_free": forward_residuals(ref, [[bos_id, int(t)] for t in ids])[:, :, 1]}
    for kernel, pred in preds.items():
        want = M.score_layers(pred[1:, types], truth[1:, types])
        got = scores[scores["kernel"] == kernel].pivot(index="depth", columns="metric", values="value")
        for m in M.METRICS:
            np.testing.assert_allclose(got[m].to_numpy(), want[m], rtol=1e-4, atol=1e-5, err_msg=f"{kernel} {m}")


def test_summary_shape_and_standard_error(scores):
    s = RT.rollout_summary(scores)
    assert list(s["kernel"]) == list(RT.DEFAULT_KERNELS)  # paper order
    for m in M.METRICS:
        assert f"{m}_se" in s
    for k in ("mean_field", "cooc"):
        for m in M.METRICS:
            v = scores[(scores["kernel"] == k) & (scores["metric"] == m)].sort_values("depth")["value"].to_numpy()
            row = s[s["kernel"] == k].iloc[0]
            assert row[m] == pytest.approx(v.mean())
            assert row[f"{m}_se"] == pytest.approx(v.std(ddof=1) / np.sqrt(v.size))
    md = RT.summary_markdown(s, title="t")
    assert md.count("\n| ") == len(RT.DEFAULT_KERNELS) + 1 and "Mean field" in md and "best on both metrics" in md


def test_summary_se_on_known_values():
    rows = []
    for k, vals in (("mean_field", [0.9, 0.8, 0.7]), ("meanq", [0.5, 0.5, 0.5])):
        for d, v in enumerate(vals, start=1):
            for m in M.METRICS:
                rows.append({"kernel": k, "pinned": False, "depth": d, "metric": m, "value": v, "n_types": 10})
    s = RT.rollout_summary(pd.DataFrame(rows)).set_index("kernel")
    assert s.loc["mean_field", "cosine"] == pytest.approx(0.8)
    assert s.loc["mean_field", "cosine_se"] == pytest.approx(0.1 / np.sqrt(3))
    assert s.loc["meanq", "cosine_se"] == pytest.approx(0.0)
    assert s.loc["mean_field", "n_layers"] == 3


def test_claim_check():
    def summ(vals):
        return pd.DataFrame([{"kernel": k, "pinned": False, "cosine": c, "rel_error": e} for k, (c, e) in vals.items()])

    ok = RT.claim_check(summ({"mean_field": (0.9, 0.4), "cooc": (0.8, 0.5), "P0only": (0.9, 0.4)}))
    assert ok["holds"] and ok["cosine"]["ties"] == ["P0only"] and ok["cosine"]["best_baseline"] == "cooc"
    bad = RT.claim_check(summ({"mean_field": (0.9, 0.6), "cooc": (0.8, 0.5)}))
    assert bad["cosine"]["holds"] and not bad["rel_error"]["holds"] and not bad["holds"]
    assert bad["rel_error"]["best_baseline"] == "cooc"


def test_pinning_adds_pinned_rows(stores):
    mt, model, ad, p, _ = stores
    df = RO.run_rollouts(model, ad, p["stats"], p["eval"], kernels=["mean_field", "meanq"], pin=True, rogue_factor=1.5)
    pinned = df[df["pinned"]]
    assert len(pinned) == len(df) // 2 and (pinned["n_pinned"] > 0).all()
    assert np.isfinite(df["value"]).all()
    s = RT.rollout_summary(df)
    assert len(s) == 4 and "(pinned, " in RT.summary_markdown(s)
    none = RO.run_rollouts(model, ad, p["stats"], p["eval"], kernels=["mean_field"], pin=True, rogue_factor=1e9)
    assert not none["pinned"].any()  # no rogue dimension: no duplicate rows


def test_every_kernel_keeps_rows_stochastic_on_store(stores):
    mt, model, ad, p, _ = stores
    st, ev = S.open_pair(p["x/stats"], p["x/eval"])
    setup = RO.prepare(ad, st, ev)
    for name in K.KERNEL_NAMES:
        K.check_row_stochastic(RO.build_kernel(name, setup, model=model, seed=1), atol=1e-5)


def test_rollout_accepts_a_store_from_rounded_partials_within_their_bound(stores, tmp_path):
    """A store merged from partials rounded to k mantissa bits (stats.partial_mantissa_bits) has rows of P that
    sum to 1 only within 2^-(k+1): the rollout's row check takes that bound from the store's attribute, and still
    refuses such rows when the store does not say it was rounded. (k = 3 here, so that the rounding is far above
    the check's own 1e-4.)"""
    from mfpipe.stats import load_partial, merge_sums, save_partial

    mt, model, ad, p, tracked = stores
    tokens = zipf_windows(N_WINDOWS, seed=1)  # the fixture's statistics half
    bits = 3
    parts = []
    for i, chunk in enumerate((tokens[:10], tokens[10:])):
        sums = accumulate_shard(model, ad, chunk, tracked, batch_size=8, device="cpu", progress=False)
        parts.append(load_partial(save_partial(tmp_path / f"shard-{i}.zarr", sums, mantissa_bits=bits))[0])
    merged = merge_sums(parts)
    meta = {"model": "tiny", "revision": "r1", "half": "stats", "corpus": "zipf", "corpus_fingerprint": "fp-zipf",
            "model_type": ad.model_type}
    rounded = write_store(finalize(merged, tracked, dict(meta, partial_mantissa_bits=bits)), tmp_path / "rounded.zarr")
    unsaid = write_store(finalize(merged, tracked, meta), tmp_path / "unsaid.zarr")
    P = open_stats(rounded).P().values.astype(np.float64)
    dev = np.nanmax(np.abs(P.sum(-1) - 1.0))
    assert 1e-3 < dev <= 2.0 ** -(bits + 1) + 1e-6, dev  # off by more than the check's 1e-4, within the bound
    df = RO.run_rollouts(model, ad, rounded, p["eval"], kernels=["mean_field"], model_name="tiny", revision="r1")
    assert np.isfinite(df["value"]).all()
    with pytest.raises(ValueError, match="kernel rows do not sum to 1"):
        RO.run_rollouts(model, ad, unsaid, p["eval"], kernels=["mean_field"], model_name="tiny", revision="r1")


# ------------------------------------------------------------------------------------------ coverage
def test_attention_coverage_rows_sum_to_one(stores):
    mt, model, ad, p, _ = stores
    df = AC.attention_coverage([p["stats"], p["x/stats"]], expect={"half": "stats"})
    assert len(df) == 2
    np.testing.assert_allclose(df[["tracked", "position0", "other"]].sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(df["tracked_share_nonsink"], df["tracked"] / (df["tracked"] + df["other"]))
    with pytest.raises(ProvenanceError):
        AC.attention_coverage([p["eval"]], expect={"half": "stats"})


# ------------------------------------------------------------------------------------------ cross-corpus
def test_cross_corpus_diagonal_equals_plain_rollout(stores, scores):
    mt, model, ad, p, tracked = stores
    corpora = {"zipf": (p["stats"], p["eval"]), "other": (p["x/stats"], p["x/eval"])}
    df = RO.cross_corpus(model, ad, corpora, "zipf", model_name="tiny", revision="r1")
    assert set(df["stats_corpus"]) == {"zipf", "other", "context-free"}
    assert np.isfinite(df["value"]).all()
    for kernel, row in (("mean_field", "zipf"), ("context_free", "context-free")):
        diag = df[(df["stats_corpus"] == row) & (df["eval_corpus"] == "zipf")].sort_values(["metric", "depth"])
        plain = scores[scores["kernel"] == kernel].sort_values(["metric", "depth"])
        np.testing.assert_allclose(diag["value"].to_numpy(), plain["value"].to_numpy(), rtol=1e-6, atol=1e-7)
    # the two tracked types absent from the second corpus are never scored where it is involved
    n = df.groupby(["stats_corpus", "eval_corpus"])["n_types"].max()
    assert n[("zipf", "zipf")] == S.eval_types(open_stats(p["stats"]), open_stats(p["eval"])).size
    assert n[("other", "zipf")] <= n[("zipf", "zipf")] - 2 and n[("zipf", "other")] <= n[("zipf", "zipf")] - 2
    s = RT.cross_corpus_summary(df)
    assert len(s) == 3 * 2
    md = RT.matrix_markdown(s)
    assert "**" in md and "context-free" in md
    with pytest.raises(ProvenanceError):
        RO.cross_corpus(model, ad, {**corpora, "bad": (p["eval"], p["eval"])}, "zipf")


# ------------------------------------------------------------------------------------ error accounting
def test_error_accounting_tables(stores):
    """Values, not shapes: (a)(b)(c) and the teacher-forced attention from per-occurrence / HF-only references
    on the statistics windows, anisotropy from its definition, all scored against the evaluation half."""
    mt, model, ad, p, tracked = stores
    L = ad.n_layers
    st, ev = S.open_pair(p["stats"], p["eval"])
    setup = RO.prepare(ad, st, ev)
    types = setup.types
    truth = ev.centroids().values
    ref = Ref(model)

    def check(table, key, pred, meas, label):
        want = M.score_layers(pred[:, types], meas[:, types])
        for m in M.METRICS:
            got = table[table["metric"] == m].sort_values("layer")["value"].to_numpy()
            np.testing.assert_allclose(got, want[m], rtol=1e-4, atol=1e-5, err_msg=f"{label} {m}")

    ed = AC.error_decomposition_table(ad, setup)
    assert len(ed) == 3 * L * len(M.METRICS) and np.isfinite(ed["value"]).all()
    want = estimators_reference(ref, zipf_windows(N_WINDOWS, seed=1).astype(np.int64), tracked)  # the stats windows
    for k in "abc":
        sub = ed[ed["estimator"] == k]
        assert set(sub["label"]) == {RT.ESTIMATORS[k]}
        check(sub, "layer", want[k], truth[1:], k)
    assert "unconditional value means" in RT.error_decomposition_markdown(ed, "t")
    # with pass 2's value means (the pipeline's: its deviation store) the note says so, and not the other
    ed2 = ed.assign(label=ed["label"].where(ed["estimator"] != "b", RT.ESTIMATORS["b_pass2"]))
    md2 = RT.error_decomposition_markdown(ed2, "t")
    assert RT.ESTIMATORS["b_pass2"] in md2 and "E_s[vbar_t] of pass 2" in md2 and "unconditional" not in md2

    # teacher-forced: sum_h (sum_t P_st v_h(c_t)) W_O^h from the stats half vs sum_h zbar^h W_O^h of the eval half,
    # both without the output-projection bias (o_proj(reads) - o_proj(0))
    c, P, zev = st.centroids().values, st.P().values, ev.zbar().values
    b = forward_residuals(ref, [[int(st.attrs["bos_id"])]])[:, 0, 0]
    n = tracked.n
    pred, meas = np.zeros((L, n, ad.d_model)), np.zeros((L, n, ad.d_model))
    with torch.no_grad():
        for l in range(L):
            o = ref.o_proj_module(l)
            o0 = o(torch.zeros(ref.H * ref.dh))
            keys = [torch.as_tensor(c[l, t]) for t in range(n)] + [torch.as_tensor(b[l]), torch.as_tensor(c[l].mean(0))]
            V = [[ref.value_head(l, kx, h) for kx in keys] for h in range(ref.H)]
            for s in range(n):
                z = [sum(float(P[l, h, s, t]) * V[h][t] for t in range(n + 2)) for h in range(ref.H)]
                pred[l, s] = (o(torch.cat(z).float()) - o0).numpy()
                meas[l, s] = (o(torch.as_tensor(np.nan_to_num(zev[l, :, s]).reshape(-1)).float()) - o0).numpy()
    tf = AC.teacher_forced_table(ad, setup)
    check(tf, "layer", pred, meas, "teacher-forced")

    mg = AC.mlp_gap_table(ad, ev)
    assert len(mg) == L and np.isfinite(mg[list(M.METRICS)].to_numpy()).all()
    cl = AC.clustering_table(ad, ev)
    assert len(cl) == L + 1
    assert ((cl["eta2"] >= -1e-9) & (cl["eta2"] <= 1 + 1e-9)).all()
    assert np.isfinite(cl.loc[cl["depth"] < L, "jensen_rel_median"]).all()
    assert np.isnan(cl.loc[cl["depth"] == L, "jensen_rel_median"]).all()
    an = AC.anisotropy_table(ev)
    ce = ev.centroids().values[:, ev.query_count().values >= 1].astype(np.float64)
    cbar = ce.mean(1)
    np.testing.assert_allclose(an["norm_mean"], np.linalg.norm(cbar, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(an["mean_dist"], np.linalg.norm(ce - cbar[:, None], axis=-1).mean(1), rtol=1e-5)
    if mt == "gpt_neox":  # rotary: a type's layer-0 residual is its embedding, identical at every occurrence
        assert cl.loc[0, "rel_rms_median"] == pytest.approx(0.0, abs=1e-6)
        assert mg.loc[0, "cosine"] == pytest.approx(1.0, abs=1e-5)  # parallel MLP reads the block input


# ------------------------------------------------------------------------------------------- figures
def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_write_pdf_and_png_of_what_the_tables_hold(stores, scores, tmp_path, monkeypatch):
    mt, model, ad, p, _ = stores
    if mt != "gpt2":
        pytest.skip("the figures depend only on the tables; one architecture suffices")
    st, ev = S.open_pair(p["stats"], p["eval"])
    setup = RO.prepare(ad, st, ev)
    corpora = {"zipf": (p["stats"], p["eval"]), "other": (p["x/stats"], p["x/eval"])}
    tables = {
        "rollout": scores,
        "teacher_forced": AC.teacher_forced_table(ad, setup),
        # (b) labelled as the pipeline's run labels it (pass 2's value means): the legend reads the table's label
        "error_decomposition": AC.error_decomposition_table(ad, setup).pipe(
            lambda t: t.assign(label=t["label"].where(t["estimator"] != "b", RT.ESTIMATORS["b_pass2"]))),
        "clustering": AC.clustering_table(ad, ev),
        "cross_corpus": RT.cross_corpus_summary(RO.cross_corpus(model, ad, corpora, "zipf", context_free=False)),
    }
    fns = {"rollout": F.rollout_figure, "teacher_forced": F.teacher_forced_figure,
           "error_decomposition": F.error_decomposition_figure, "clustering": F.clustering_figure,
           "cross_corpus": F.cross_corpus_figure}
    figures = capture(monkeypatch)
    drawn = {}
    for name, fn in fns.items():
        csv = tmp_path / f"{name}.csv"
        tables[name].to_csv(csv, index=False)  # figures are drawn from the CSV tables
        pdf, png = fn(csv, tmp_path / "figs" / name)
        assert pdf.read_bytes()[:5] == b"%PDF-" and _is_png(png), name
        drawn[name] = main_axes(figures[-1])
    assert not [f for f in (tmp_path / "figs").iterdir() if f.name.startswith(".")]  # no temporary left
    # what is drawn is the tables' numbers, on whole-numbered layer / depth axes
    sc = tables["rollout"]
    for ax, metric in zip(drawn["rollout"], ("cosine", "rsa", "rel_error", "norm_ratio")):
        got = lines(ax)
        for k, g in sc[(sc["metric"] == metric) & ~sc["pinned"].astype(bool)].groupby("kernel"):
            g = g.sort_values("depth")
            x, y = got[F.KERNEL_LABELS.get(k, k)]
            np.testing.assert_array_equal(x, g["depth"])
            np.testing.assert_allclose(y, g["value"], rtol=1e-6)
        assert np.array_equal(tick_values(ax), np.round(tick_values(ax)))
    for name, key, labels in (("teacher_forced", None, {"mean field": None}),
                              ("error_decomposition", "estimator", dict(zip(tables["error_decomposition"].label,
                                                                            tables["error_decomposition"].estimator)))):
        t = tables[name]
        if key:
            assert {lab for ax in drawn[name] for lab in lines(ax)} == set(labels), labels
        for ax, metric in zip(drawn[name], ("cosine", "norm_ratio" if name == "teacher_forced" else "rel_error")):
            for label, (x, y) in lines(ax).items():
                sel = (t["metric"] == metric) & ((t[key] == labels[label]) if key else True)
                g = t[sel].sort_values("layer")
                np.testing.assert_array_equal(x, g["layer"])
                np.testing.assert_allclose(y, g["value"], rtol=1e-6)
            assert set(tick_values(ax)) <= set(t["layer"])
    cl = tables["clustering"].sort_values("depth")
    rms, eta, _ = drawn["clustering"]
    np.testing.assert_allclose(lines(rms)["median"][1], cl["rel_rms_median"], rtol=1e-6)
    np.testing.assert_allclose(lines(eta)[r"$\eta^2_z$ (z-scored)"][1], cl["eta2_z"], rtol=1e-6)
    cc = tables["cross_corpus"]
    (heat, *_) = drawn["cross_corpus"]
    want = cc.pivot(index="stats_corpus", columns="eval_corpus", values="cosine")
    rows = [t.get_text() for t in heat.get_yticklabels()]
    cols = [t.get_text().replace("\n", " ") for t in heat.get_xticklabels()]
    np.testing.assert_allclose(image(heat), want.loc[rows, cols].to_numpy(float), rtol=1e-6)


def test_the_divergence_figure_draws_its_tables_on_whole_blocks_and_depths(tmp_path, monkeypatch):
    """App. llama's figure from its four tables (issue 60: its blocks and depths had ticks at 0.2 apart)."""
    rng = np.random.default_rng(0)
    L = 3
    steps = pd.DataFrame({"layer": range(L), "amp_attention": rng.uniform(1, 2, L), "amp_mlp": rng.uniform(1, 3, L),
                          "amp_block": [1.2, 2.5, 1.7]})
    curvature = pd.DataFrame([{"layer": l, "alpha": a, "amp_real": 1 + a * l, "amp_random": 1 + a}
                              for l in range(L) for a in (0.25, 0.5, 1.0)])
    tokens = pd.DataFrame({"layer": range(L), "median": [1.1, 1.3, 1.2], "p99": [3.0, 5.0, 4.0], "max": [9.0, 30.0, 12.0]})
    magnitude = pd.DataFrame({"depth": range(1, L + 1), "ratio": [0.9, 1.4, 2.2]})
    figures = capture(monkeypatch)
    F.divergence_figure(steps, curvature, tokens, magnitude, tmp_path / "div")
    fig = figures[-1]
    fig.draw_without_rendering()
    amp, curv, mag, tail = main_axes(fig)
    for col, label in (("amp_attention", "attention update"), ("amp_mlp", "MLP"), ("amp_block", "block")):
        np.testing.assert_allclose(lines(amp)[label][1], steps[col])
    peak = curvature[curvature["layer"] == 1]  # the block of largest amplification
    np.testing.assert_allclose(lines(curv)["real error"][1], peak["amp_real"])
    np.testing.assert_allclose(lines(curv)["random, same norms"][1], peak["amp_random"])
    assert [t.get_text() for t in curv.get_xticklabels()] == ["0.25", "0.5", "1"]
    (x, y), = lines(mag).values()
    np.testing.assert_allclose(y, magnitude["ratio"])
    for col in ("median", "p99", "max"):
        np.testing.assert_allclose(lines(tail)[col][1], tokens[col])
    assert tick_values(amp).tolist() == tick_values(tail).tolist() == [0, 1, 2]
    assert tick_values(mag).tolist() == [1, 2, 3]
