"""Issue 44 item 5: the paper's figures and tables that had no target -- fig:zipf (rank-frequency of the stats half),
fig:curves (per-layer cross-corpus quality), the "circuits straddle the ranking" role table, tab:gemma's
single-revision S-bar / induction correlation and fig:vocab-mfgap -- each against a direct reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from figure_data import capture, lines, main_axes
from synthetic_stats import BOS, VOCAB, NamedList, run_job, windows, write_corpus, tracked_set


def _job_files(tmp_path, *names):
    return NamedList(**{n.split(".")[0]: str(tmp_path / n) for n in names})


# ----------------------------------------------------------------------------------------------------- fig:zipf
def test_rank_frequency_is_the_bincount_of_the_stats_shards_and_the_cutoff_its_rank_n_row(tmp_path, monkeypatch):
    tok = windows(30, seed=4)
    tok[3, 5] = BOS  # a BOS inside a window: counted in the denominator, never ranked
    ts = tracked_set(tok, n=8)
    write_corpus(tmp_path / "corpus", tok, ts)
    (tmp_path / "corpus" / "shards" / "fingerprint.json").write_text(json.dumps({"vocab_size": VOCAB, "bos_id": BOS}))
    tables = []
    for m in ("a", "b"):
        out = tmp_path / f"rank_frequency_{m}.csv"
        run_job("corpus", "rank_frequency", input=NamedList(shards=str(tmp_path / "corpus" / "shards")),
                output=NamedList(str(out)), params=NamedList(), log=[str(tmp_path / f"{m}.log")])
        tables.append(str(out))
    got = pd.read_csv(tables[0])
    # reference: a direct bincount of every window's positions >= 1, ranked by hand
    counts = np.bincount(tok[:, 1:].ravel(), minlength=VOCAB)
    ranked = sorted((i for i in range(VOCAB) if counts[i] > 0 and i != BOS), key=lambda i: (-counts[i], i))
    assert got["type_id"].tolist() == ranked
    assert got["count"].tolist() == [int(counts[i]) for i in ranked]
    assert got["rank"].tolist() == list(range(1, len(ranked) + 1))
    np.testing.assert_allclose(got["frequency"], [counts[i] / counts.sum() for i in ranked], rtol=1e-12)
    out = _job_files(tmp_path, "zipf.csv", "zipf_md.md", "zipf_pdf.pdf", "zipf_png.png")
    out = NamedList(csv=out.zipf, md=out.zipf_md, pdf=out.zipf_pdf, png=out.zipf_png)
    figures = capture(monkeypatch)
    run_job("corpus", "zipf", input=NamedList(tables=tables), output=out,
            params=NamedList(models=["a", "b"], n_tracked=8), log=[str(tmp_path / "zipf.log")])
    summary = pd.read_csv(out.csv)
    assert summary["model"].tolist() == ["a", "b"]
    row = summary.iloc[0]
    assert row["n_tracked"] == 8 and row["cutoff_count"] == counts[ranked[7]]
    assert row["cutoff_frequency"] == pytest.approx(counts[ranked[7]] / counts.sum(), rel=1e-12)
    # the top-N rows are the tracked set: their frequencies sum to its position coverage
    from mfpipe.corpus.tracked import select_tracked

    sel = select_tracked(counts, 8, BOS, decode=str)
    assert sel.type_ids.tolist() == ranked[:8]
    assert row["top_n_coverage"] == pytest.approx(sel.coverage, rel=1e-12)
    assert Path(out.pdf).stat().st_size > 0 and Path(out.png).stat().st_size > 0
    # what is drawn: each model's rank-frequency curve is its table, the cutoff marked at its rank-N row
    (ax,) = main_axes(figures[-1])
    drawn = lines(ax)
    for m, table in zip(("a", "b"), tables):
        t = pd.read_csv(table)
        (x, y), = [v for k, v in drawn.items() if k.startswith(f"{m} (")]
        np.testing.assert_array_equal(x, t["rank"])
        np.testing.assert_allclose(y, t["frequency"], rtol=1e-12)
    marks = [v for k, v in drawn.items() if k.startswith("_line") and len(v[0]) == 1]
    assert [(float(x[0]), float(y[0])) for x, y in marks] == [(8.0, pytest.approx(row["cutoff_frequency"]))] * 2


# --------------------------------------------------------------------------------------------------- fig:curves
def _cross_corpus_scores(rng) -> pd.DataFrame:
    rows = []
    corpora = ["owt", "wiki", "books"]
    for x in corpora + ["context-free"]:
        for y in corpora:
            for depth in (1, 2, 3, 4):
                for metric in ("cosine", "rel_error"):
                    rows.append({"model": "m", "revision": "r", "stats_corpus": x, "eval_corpus": y, "depth": depth,
                                 "frac_depth": depth / 4, "metric": metric, "value": rng.random(), "n_types": 9})
    return pd.DataFrame(rows)


def test_curves_replication_rows_are_the_cross_corpus_diagonal_and_the_job_draws_them(tmp_path, monkeypatch):
    from mfpipe.experiments.rollout.figures import curve_rows

    df = _cross_corpus_scores(np.random.default_rng(0))
    path = tmp_path / "cross_corpus_scores.csv"
    df.to_csv(path, index=False)
    rep, gen = curve_rows(path)
    cos = df[df["metric"] == "cosine"]
    for x in ("owt", "wiki", "books"):
        want = cos[(cos["stats_corpus"] == x) & (cos["eval_corpus"] == x)].sort_values("depth")
        got = rep[rep["stats_corpus"] == x].sort_values("depth")
        assert got["value"].tolist() == want["value"].tolist() and got["depth"].tolist() == [1, 2, 3, 4]
    assert set(rep["stats_corpus"]) == {"owt", "wiki", "books"} and (rep["stats_corpus"] == rep["eval_corpus"]).all()
    # generalization: every statistics corpus (and the baseline) against the primary corpus, the table's first
    assert set(gen["eval_corpus"]) == {"owt"} and set(gen["stats_corpus"]) == {"owt", "wiki", "books", "context-free"}
    want = cos[cos["eval_corpus"] == "owt"]["value"].tolist()
    assert gen["value"].tolist() == want
    out = NamedList(pdf=str(tmp_path / "curves.pdf"), png=str(tmp_path / "curves.png"))
    figures = capture(monkeypatch)
    run_job("experiments.rollout", "plot_figure", input=NamedList(table=str(path)), output=out,
            params=NamedList(kind="curves", title="curves"), log=[str(tmp_path / "curves.log")])
    assert Path(out.pdf).stat().st_size > 0 and Path(out.png).stat().st_size > 0
    # what is drawn: a curve per statistics corpus in each row, the table's values by fractional depth
    top, bottom = main_axes(figures[-1])
    for ax, rows in ((top, rep), (bottom, gen)):
        drawn = lines(ax)
        assert set(drawn) == {f"stats: {x}" for x in rows["stats_corpus"].unique()}
        for x, g in rows.groupby("stats_corpus"):
            g = g.sort_values("frac_depth")
            np.testing.assert_allclose(drawn[f"stats: {x}"][0], g["frac_depth"])
            np.testing.assert_allclose(drawn[f"stats: {x}"][1], g["value"])


# ------------------------------------------------------------------------------- circuits straddle the ranking
def test_bos_sink_from_the_kernel_equals_a_per_position_loop_on_a_tiny_model(tmp_path):
    from stats_reference import reference_capture, tiny_stats_half

    from mfpipe.experiments.ranking.roles import bos_sink_scores

    model, _, tokens, tracked, _, _, st = tiny_stats_half("gpt2", tmp_path, model_seed=3, n_windows=12,
                                                          token_seed=2, batch_size=6)
    import torch

    probs = reference_capture(model, torch.from_numpy(tokens.astype(np.int64)))["probs"]  # [L, B, H, T, T]
    L, B, H = probs.shape[:3]
    q = tracked.query_bucket_lut()
    want = np.zeros((L, H))
    n = 0
    for b in range(B):
        for i in range(1, tokens.shape[1]):
            if q[tokens[b, i]] < 0:
                continue
            n += 1
            for layer in range(L):
                for h in range(H):
                    want[layer, h] += probs[layer, b, h, i, 0]
    want /= n
    P_bos = st.ds["P"].isel(key=st.bos_bucket).transpose("layer", "head", "query").values
    got = bos_sink_scores(P_bos, st.query_count().values)
    np.testing.assert_allclose(got, want, atol=2e-6)


def _ranking_table(rng, L=3, H=4) -> pd.DataFrame:
    layer, head = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")
    df = pd.DataFrame({"layer": layer.ravel(), "head": head.ravel()})
    df["head_label"] = [f"L{a}H{b}" for a, b in zip(df["layer"], df["head"])]
    for c in ("S_bar", "induction", "previous_token", "duplicate_token", "bos_sink"):
        df[c] = rng.random(len(df))
    df.loc[5, "S_bar"] = np.nan  # a head without a deviation: left out of the ranking
    df["model"], df["revision"] = "m", "r"
    df = df.sort_values("S_bar", ascending=False, na_position="last").reset_index(drop=True)
    df.insert(0, "rank", np.arange(1, len(df) + 1))
    return df


def test_role_ranks_place_each_roles_top_heads_in_the_s_bar_ranking(tmp_path):
    from mfpipe.experiments.ranking.roles import ROLES
    from mfpipe.stats import open_stats
    from synthetic_stats import make_store

    rng = np.random.default_rng(1)
    table = _ranking_table(rng)
    tok = windows(20, seed=1)
    ts = tracked_set(tok)
    store = make_store(tmp_path / "stats.zarr", tok, ts, rng.lognormal(0, 1, size=(3, 4, ts.n, ts.n + 2)),
                       revision="r", model="m")
    heads = tmp_path / "heads.csv"
    table.to_csv(heads, index=False)
    out = NamedList(csv=str(tmp_path / "roles.csv"), md=str(tmp_path / "roles.md"))
    run_job("experiments.ranking", "ranking_roles", input=NamedList(heads=str(heads), stats=str(store)), output=out,
            params=NamedList(model="m", revision="r", top=2), log=[str(tmp_path / "roles.log")])
    got = pd.read_csv(out.csv)
    st = open_stats(store)
    P = st.P().values[..., ts.n]  # [L, H, N]: the <bos> column
    w = st.query_count().values
    sink = (P * w).sum(-1) / w.sum()
    ranked = table[np.isfinite(table["S_bar"])]
    s_rank = {lab: i + 1 for i, lab in enumerate(ranked.sort_values("S_bar", ascending=False)["head_label"])}
    for role, col in ROLES:
        score = {r.head_label: (sink[r.layer, r.head] if col == "bos_sink_corpus" else getattr(r, col))
                 for r in ranked.itertuples()}
        top = sorted(score, key=lambda lab: -score[lab])[:2]
        rows = got[got["role"] == role].sort_values("role_rank")
        assert rows["head_label"].tolist() == top, role
        assert rows["rank"].tolist() == [s_rank[lab] for lab in top]
        np.testing.assert_allclose(rows["percentile"], [100 * s_rank[lab] / len(ranked) for lab in top])
        np.testing.assert_allclose(rows["score"], [score[lab] for lab in top], rtol=1e-6)
    assert "L1H1" not in set(got["head_label"])  # the head without S-bar (row 5 of the grid) is never placed


# --------------------------------------------------------------------------------------------------- tab:gemma
def test_single_revision_correlation_equals_scipy_spearman_on_the_two_columns(tmp_path):
    from scipy.stats import spearmanr

    table = _ranking_table(np.random.default_rng(2))
    table.loc[2, "induction"] = np.nan
    heads = tmp_path / "heads.csv"
    table.to_csv(heads, index=False)
    out = NamedList(csv=str(tmp_path / "single.csv"), md=str(tmp_path / "single.md"))
    run_job("experiments.ranking", "exp3_single", input=NamedList(heads=str(heads)), output=out, params=NamedList(),
            log=[str(tmp_path / "single.log")])
    got = pd.read_csv(out.csv).iloc[0]
    ok = table["S_bar"].notna() & table["induction"].notna()
    want = spearmanr(table.loc[ok, "S_bar"], table.loc[ok, "induction"])
    assert got["n_heads"] == ok.sum() == len(table) - 2
    assert got["spearman"] == pytest.approx(want.statistic, abs=1e-12)
    assert got["p_value"] == pytest.approx(want.pvalue, rel=1e-9)
    assert (got["model"], got["revision"]) == ("m", "r")


# ----------------------------------------------------------------------------------------------- fig:vocab-mfgap
def test_vocab_mfgap_figure_draws_every_arm_and_needs_steps(tmp_path, monkeypatch):
    from mfpipe.experiments.substitution.figures import vocab_mfgap_figure

    rows = []
    for n, f in ((1000, 1.0), (2000, 1.4)):
        for s in (0, 16, 256, 1000):
            lm = 8.0 / (1 + s / 100)
            rows.append({"n_tracked": n, "revision": f"step{s}", "step": s, "L_model": lm, "L_MF": lm + 0.1 * f,
                         "delta_L": 0.1 * f, "D_MF": 0.2, "substituted_share": 0.5 * f})
    path = tmp_path / "topn.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    out = NamedList(pdf=str(tmp_path / "vm.pdf"), png=str(tmp_path / "vm.png"))
    figures = capture(monkeypatch)
    run_job("experiments.substitution", "figure_vocab_mfgap", input=NamedList(table=str(path), training=[]), output=out,
            params=NamedList(window=[16, 256], band=[0.1, 0.8], title="t"), log=[str(tmp_path / "vm.log")])
    assert Path(out.pdf).stat().st_size > 0 and Path(out.png).stat().st_size > 0
    # what is drawn: per arm (columns, N ascending) L_model and L_MF on top, ΔL and D_MF (twin axis) below
    fig = figures[-1]
    panels = main_axes(fig)
    tops = [a for a in panels if a.get_title().startswith("N = ")]
    table = pd.DataFrame(rows)
    assert [a.get_title().split(" (")[0] for a in tops] == ["N = 1000", "N = 2000"]
    for ax, n in zip(tops, (1000, 2000)):
        g = table[table["n_tracked"] == n].sort_values("step")
        drawn = lines(ax)
        for col in ("L_model", "L_MF"):
            key = r"$L_\mathrm{model}$" if col == "L_model" else r"$L_\mathrm{MF}$"
            np.testing.assert_array_equal(drawn[key][0], g["step"])
            np.testing.assert_allclose(drawn[key][1], g[col])
    below = {a.get_position().x0: a for a in panels if r"$\Delta L$" in lines(a)}
    twins = {a.get_position().x0: a for a in panels if r"$D_\mathrm{MF}$" in lines(a)}
    for (x0, ax), n in zip(sorted(below.items()), (1000, 2000)):
        g = table[table["n_tracked"] == n].sort_values("step")
        np.testing.assert_allclose(lines(ax)[r"$\Delta L$"][1], g["delta_L"])
        np.testing.assert_allclose(lines(twins[x0])[r"$D_\mathrm{MF}$"][1], g["D_MF"])
    bad = pd.DataFrame(rows).assign(step=np.nan)
    with pytest.raises(ValueError, match="training step"):
        vocab_mfgap_figure(bad, tmp_path / "bad")
