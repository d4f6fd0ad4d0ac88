"""The positional slice on tiny models (issue 43; App. positional): every head's posVar from collected occurrences
against a slow per-head, per-coordinate ``numpy.linalg.lstsq`` loop on the residual-unit write; the cluster's
readings and S; the ablation's arms (an empty subspace costs nothing, bit for bit; the carriers' arm equals a plain
torch-hook forward's loss); the repeated-text table and the type-class test against direct computations; the tables
and the figure. A learned position table (GPT-2) and a rotary model (Llama: its W_pos readings NaN)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from stats_reference import tiny_stats_half, zipf_windows

from mfpipe.experiments.positional import ablation as Ab
from mfpipe.experiments.positional import analysis as An
from mfpipe.experiments.positional import collect as C
from mfpipe.experiments.positional import readings as Rd
from mfpipe.experiments.positional import tables as Tb
from mfpipe.meanfield.kernel import kernel_from_store

T_CTX = 32
# every head of the tiny models' 8 is a top head (top_fraction 1), so every reading runs on all of them
CFG = dict(min_position=4, max_other=1.0, top_fraction=1.0, min_top=1, posvar_threshold=0.0, carrier_threshold=0.0,
           wpos_components=6, write_rank=2, ablation_dim=3, ridge_alpha=1.0, seed=0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def ran(request, tmp_path_factory):
    model, ad, _, tracked, _, _, st = tiny_stats_half(request.param, tmp_path_factory.mktemp("pos"), model_seed=5,
                                                      n_windows=24, token_seed=1, batch_size=8, context_length=T_CTX)
    ev = zipf_windows(16, T=T_CTX, seed=2).astype(np.int64)
    kernel = kernel_from_store(st, tracked, min_count=1)
    zbar = torch.from_numpy(np.asarray(st.zbar().transpose("query", "layer", "head", "head_dim").values, np.float32))
    w, p = C.sample_occurrences(len(ev), T_CTX, stride=1, min_position=1, budget=10**6, seed=0)
    occ = C.collect(ad, kernel, zbar, ev, tracked.query_bucket_lut(), w, p, batch_size=8)
    O = np.stack([ad.out_proj_slices(l).double().numpy() for l in range(ad.n_layers)])
    W = ad.position_table()
    W_pos = None if W is None else W.double().numpy()[:T_CTX]
    S_bar = np.arange(ad.n_layers * ad.n_heads, dtype=float).reshape(ad.n_layers, ad.n_heads)[::-1].copy()
    return dict(model=model, ad=ad, ev=ev, occ=occ, O=O, W_pos=W_pos, S_bar=S_bar, kernel=kernel, tracked=tracked)


def test_posvar_of_every_head_equals_a_per_coordinate_lstsq_loop(ran):
    occ, O = ran["occ"], ran["O"]
    heads = An.head_table(occ, O, ran["W_pos"], ran["S_bar"], T_CTX, CFG)
    keep = An.head_masks(occ, CFG["min_position"], CFG["max_other"])
    # the paper's 11 regressors written out (App. positional), not the code's position_basis: an intercept, p̃ = p / T,
    # p̃² and sin / cos of 2πkp̃ for k = 1..4
    x = np.asarray(occ.position, dtype=np.float64) / T_CTX
    basis = np.column_stack([np.ones_like(x), x, x ** 2] + [f(2 * np.pi * k * x) for k in (1, 2, 3, 4)
                                                            for f in (np.sin, np.cos)])
    for r in heads.itertuples():
        m = keep[:, r.layer, r.head]
        Y = occ.delta[m, r.layer, r.head].astype(np.float64) @ O[r.layer, r.head]  # residual units, [n, d]
        A = basis[m]
        num = den = 0.0
        for j in range(Y.shape[1]):  # one coordinate at a time
            beta, *_ = np.linalg.lstsq(A, Y[:, j], rcond=None)
            num += float(((A @ beta - Y[:, j].mean()) ** 2).sum())
            den += float(((Y[:, j] - Y[:, j].mean()) ** 2).sum())
        assert r.posvar == pytest.approx(num / den, rel=1e-6, abs=1e-9)
    assert heads["wpos"].all() == (ran["W_pos"] is not None)
    assert heads["wpos_share"].isna().all() == (ran["W_pos"] is None)  # rotary: no code readings, NaN



def test_the_cluster_is_chosen_among_a_share_of_the_models_heads_by_deviation():
    """Issue 60 item 8: the cluster rule is relative to the model's heads. A mini-like model (2 layers x 8 heads) whose
    lowest-deviation head (S̄ rank 16, as L0H6 of the mini GPT-2) and its rank-2 head have a high posVar: the default
    rule (the top 0.14 of the heads by S̄, at least 2) looks at the top 2 only, so the cluster is the rank-2 head; an
    absolute count at least the number of heads (the old n_top 20) would have taken the rank-16 head too. GPT-2 small's
    144 heads keep the paper's top 20."""
    L, H = 2, 8
    S_bar = np.linspace(1.0, 0.1, L * H)[np.random.default_rng(0).permutation(L * H)].reshape(L, H)
    order = np.argsort(-S_bar, axis=None)  # flat head index by S̄, highest first
    rank = np.empty(L * H, int)
    rank[order] = np.arange(1, L * H + 1)
    posvar = np.full(L * H, 0.1)
    posvar[order[[1, 15]]] = [0.6, 0.95]  # rank 2 and rank 16
    table = pd.DataFrame(dict(layer=np.repeat(np.arange(L), H), head=np.tile(np.arange(H), L), S_bar=S_bar.ravel(),
                              S_rank=rank, posvar=posvar, wpos=True, wpos_share=0.5))
    cfg = {k: v for k, v in An.DEFAULTS.items() if k in ("top_fraction", "min_top", "posvar_threshold",
                                                         "carrier_threshold")}
    assert cfg == dict(top_fraction=0.14, min_top=2, posvar_threshold=0.5, carrier_threshold=0.3)
    # a plain reference: walk the heads by S̄ and keep the first k that pass
    def by_hand(k):
        return [divmod(int(i), H) for i in order[:k] if posvar[i] >= 0.5]

    cl, car = An.cluster(table, {})
    assert An.n_top(L * H, {}) == 2 and cl == car == by_hand(2) == [divmod(int(order[1]), H)]
    assert divmod(int(order[15]), H) not in cl
    assert An.cluster(table, {"top_fraction": 1.0})[0] == by_hand(16) and len(by_hand(16)) == 2  # the degenerate rule
    assert An.cluster(table, {"min_top": 1, "top_fraction": 0.05})[0] == []  # top 1: no high-posVar head there
    # the share, rounded half up, with its floor, never more than the heads there are
    assert [An.n_top(n, {}) for n in (144, 208, 16, 4, 1)] == [20, 29, 2, 2, 1]
    assert An.n_top(16, {"top_fraction": 0.25, "min_top": 1}) == 4 and An.n_top(10, {"top_fraction": 0.25}) == 3
    assert An.n_top(16, {"min_top": 40}) == 16


def test_the_schema_holds_the_relative_rule_and_names_the_replaced_count():
    """The schema's defaults are the analysis's, and a config of the earlier absolute count (`positional.n_top`) is
    told what replaced it, in one line."""
    from mfpipe.workflow.config import ConfigError, apply_defaults, validate_schema

    cfg = apply_defaults({"positional": {}})["positional"]
    assert {k: cfg[k] for k in ("top_fraction", "min_top")} == {"top_fraction": 0.14, "min_top": 2}
    assert {k: An.DEFAULTS[k] for k in ("top_fraction", "min_top")} == {"top_fraction": 0.14, "min_top": 2}
    with pytest.raises(ConfigError, match=r"positional\.n_top was replaced by positional\.top_fraction .* positional\.min_top"):
        validate_schema({"positional": {"n_top": 20}})


def test_cluster_readings_and_the_subspace(ran):
    occ, O, W_pos = ran["occ"], ran["O"], ran["W_pos"]
    heads = An.head_table(occ, O, W_pos, ran["S_bar"], T_CTX, CFG)
    cl, car = An.cluster(heads, CFG)
    assert cl == [(int(a), int(b)) for a, b in zip(heads.sort_values("S_rank")["layer"],
                                                    heads.sort_values("S_rank")["head"])][: An.n_top(len(heads), CFG)]
    assert len(cl) == len(heads) == 8
    ctab = An.cluster_tables(occ, O, W_pos, T_CTX, cl[:3], CFG)
    rows = ctab["rows"]
    assert len(rows) == 3 and rows["write_top3"].between(0, 1 + 1e-9).all()
    assert ((rows["write_top1"] <= rows["write_top2"] + 1e-12) & (rows["write_top2"] <= rows["write_top3"] + 1e-12)).all()
    assert len(ctab["overlaps"]) == 3 and ctab["overlaps"]["overlap"].between(0, 1 + 1e-9).all()
    if W_pos is not None:  # what offsets add to the code is never negative (nested OLS)
        assert (rows["offset_increment"] >= -1e-9).all() and rows["in_code_pcs"].between(0, 1 + 1e-9).all()
    S, share = An.union_subspace(ctab["fits"], cl[:3], CFG["ablation_dim"], O.shape[-1])
    none, nan = An.union_subspace(ctab["fits"], [], 3, O.shape[-1])
    assert none.shape == (O.shape[-1], 0) and np.isnan(nan)
    assert S.shape == (O.shape[-1], 3) and np.allclose(S.T @ S, np.eye(3), atol=1e-9) and 0 < share <= 1 + 1e-9
    cur = Tb.curves(occ, O, W_pos, T_CTX, cl[:2], CFG, n_bins=4)
    assert set(cur["head"]) == {f"L{l}H{h}" for l, h in cl[:2]} and (cur["n"] > 0).all()


def _hook_loss(model, ad, ids, by, S):
    """The same projection by plain torch forward hooks on the output projections: the mean next-token loss."""
    slices = [ad.out_proj_slices(l).float() for l in range(ad.n_layers)]
    St = torch.as_tensor(S, dtype=torch.float32)

    def hook_for(l):
        def hook(mod, args, out):
            x = args[0].reshape(*args[0].shape[:2], ad.n_heads, ad.d_head).float()
            write = sum(x[..., h, :] @ slices[l][h] for h in by[l])
            return (out.float() - (write @ St) @ St.T).to(out.dtype)
        return hook

    hs = [ad.out_proj_module(l).register_forward_hook(hook_for(l)) for l in by]
    try:
        with torch.no_grad():
            lg = model(torch.as_tensor(ids), use_cache=False).logits.float()
    finally:
        for h in hs:
            h.remove()
    return torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]),
                                             torch.as_tensor(ids)[:, 1:].reshape(-1), reduction="none").view(
        len(ids), -1).double().numpy()


def test_the_ablation_arms_against_torch_hooks(ran):
    model, ad, ev = ran["model"], ran["ad"], ran["ev"][:6]
    d = ad.d_model
    S = np.linalg.qr(np.random.default_rng(0).normal(size=(d, 3)))[0]
    carriers = [(0, 1), (1, 0)]
    arms = Ab.ablation_arms(carriers, ad.n_layers, ad.n_heads, S, n_random=2, seed=0)
    assert [a[0] for a in arms] == ["carriers", "non-carriers", "random", "random"]
    assert arms[1][1] == {0: [0, 2, 3], 1: [1, 2, 3]} and not np.allclose(arms[2][2], arms[3][2])
    empty = [("carriers", {0: [1], 1: [0]}, S[:, :0], 0)]
    res = Ab.run_ablation(ad, ev, arms + empty, batch_size=4)
    assert np.array_equal(res["loss"][-1], res["base"])  # nothing removed: bit-identical
    ref = _hook_loss(model, ad, ev, {0: [1], 1: [0]}, S)
    assert np.abs(res["loss"][0] - ref).max() < 1e-5 and np.abs(res["loss"][0] - res["base"]).max() > 1e-4
    assert res["consumers"].shape == (ad.n_layers, ad.n_heads) and res["consumers"][1].sum() > 0
    cats = np.zeros((len(ev), T_CTX - 1), np.int64)
    tabs = Tb.ablation_tables({**res, "loss": res["loss"][:4]}, arms, cats, ad.n_layers, ad.n_heads)
    a = tabs["arms"].set_index("arm")
    assert a.loc["random", "draws"] == 2 and a.loc["carriers", "loss_increase"] == pytest.approx(
        float((res["loss"][0] - res["base"]).mean()))
    assert a.loc["carriers", "specificity_vs_random"] == pytest.approx(
        a.loc["carriers", "loss_increase"] / a.loc["random", "loss_increase"])


def test_token_categories():
    class Tok:
        text = {1: " the", 2: "ing", 3: "42", 4: ",", 5: "\n", 6: "cat"}

        def decode(self, ids):
            return self.text[ids[0]]

    got = Ab.token_categories(Tok(), np.array([[6, 2, 1, 3, 4, 5, 1, 2]]))
    # predicted: ing (after cat: continuation), the (word-initial), 42 (number), "," (punct), \n (other), the, ing
    assert got.tolist() == [[2, 1, 0, 3, 4, 1, 2]]


def test_repeated_table_and_the_class_test_against_direct_computations():
    from scipy.stats import mannwhitneyu

    nat = np.array([[0.1, 0.2], [0.3, 0.05]])
    rep = np.array([[0.5, 0.1], [0.35, np.nan]])
    t = Rd.repeated_table(nat, np.ones((2, 2)), rep, np.ones((2, 2)))
    assert t.sort_values("rise_rank")[["layer", "head"]].values.tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]
    rng = np.random.default_rng(0)
    D_type = rng.normal(size=(1, 2, 30))
    D_type[0, 0, [3, 7, 9]] += 5  # head 0 singles out the class
    D_type[0, 1, 5] = np.nan
    occ_D = rng.normal(size=(200, 1, 2))
    occ_type = rng.integers(0, 30, size=200)
    ct = Rd.class_test(D_type, [3, 7, 9], occ_D, occ_type, np.ones((200, 1, 2), bool), name="c")
    r0 = ct.iloc[0]
    assert r0["median_rank"] == 2.0 and r0["n_types"] == 30
    inside, outside = D_type[0, 0, [3, 7, 9]], np.delete(D_type[0, 0], [3, 7, 9])
    assert r0["p_type"] == pytest.approx(mannwhitneyu(inside, outside, alternative="greater").pvalue)
    assert r0["p_type_bonferroni"] == pytest.approx(min(1.0, 2 * r0["p_type"]))
    a = occ_D[np.isin(occ_type, [3, 7, 9]), 0, 1]
    assert ct.iloc[1]["occurrence_difference"] == pytest.approx(a.mean() - occ_D[~np.isin(occ_type, [3, 7, 9]), 0,
                                                                                   1].mean())
    assert ct.iloc[1]["n_types"] == 29


def test_tables_and_figure(ran, tmp_path, monkeypatch):
    from figure_data import capture, image, lines, main_axes, tick_values

    from mfpipe.experiments.positional.figures import plot_positional

    occ, O, W_pos = ran["occ"], ran["O"], ran["W_pos"]
    heads = An.head_table(occ, O, W_pos, ran["S_bar"], T_CTX, CFG)
    cl, car = An.cluster(heads, CFG)
    heads["cluster"] = [(l, h) in cl[:2] for l, h in zip(heads["layer"], heads["head"])]
    ctab = An.cluster_tables(occ, O, W_pos, T_CTX, cl[:2], CFG)
    md = Tb.positional_markdown(heads, ctab, 0.9, 3, "tiny", "r1", CFG)
    assert "posVar" in md and "## The positional cluster" in md and ("rotary" in md) == (W_pos is None)
    figures = capture(monkeypatch)
    curves = Tb.curves(occ, O, W_pos, T_CTX, cl[:2], CFG, n_bins=4)
    plot_positional(heads, curves, tmp_path / "p.png", title="t")
    plot_positional(heads.assign(cluster=False), pd.DataFrame(columns=["head", "position", "a_mean", "lead_mean"]),
                    tmp_path / "q.png")
    assert (tmp_path / "p.png").stat().st_size > 1000 and (tmp_path / "q.png").stat().st_size > 1000
    # what is drawn: the heatmap's cell (layer, head) is that head's posVar, its axes whole layers and heads; a(p) and
    # the leading coefficient per cluster head are the curves table's
    fig = figures[0]
    fig.draw_without_rendering()
    heat, bos, lead = main_axes(fig)
    grid = image(heat)
    assert grid.shape == (ad_layers := int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1)
    for r in heads.itertuples():
        assert grid[r.layer, r.head] == pytest.approx(r.posvar, abs=1e-12)
    assert tick_values(heat, "y").tolist() == list(range(ad_layers))
    assert tick_values(heat, "x").tolist() == list(range(grid.shape[1]))
    for ax, col in ((bos, "a_mean"), (lead, "lead_mean")):
        drawn = lines(ax)
        assert set(drawn) == set(curves["head"])
        for head, g in curves.groupby("head"):
            np.testing.assert_array_equal(drawn[head][0], g["position"])
            np.testing.assert_allclose(drawn[head][1], g[col], rtol=1e-12)
        v = tick_values(ax, "x")
        assert np.array_equal(v, np.round(v))
