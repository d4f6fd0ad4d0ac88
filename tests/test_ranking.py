"""Head ranking (issue 11): the ranking tables, split-half stability and the scatter on a synthetic deviation store."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from mfpipe.experiments.ranking.figures import ccmf_scatter
from mfpipe.experiments.ranking.heads import head_roles
from mfpipe.experiments.ranking.heads import heads_table, split_half_stability, top_bottom


def _store(L=3, H=4, seed=0):
    rng = np.random.default_rng(seed)
    S = rng.uniform(0, 0.5, size=(L, H))
    cov = rng.uniform(0, 0.3, size=(L, H))
    ctx = rng.uniform(0, 0.3, size=(L, H))
    noise = rng.normal(0, 0.01, size=(2, L, H))
    ds = xr.Dataset({"S_bar": (("layer", "head"), S), "M_cov": (("layer", "head"), cov),
                     "M_ctx": (("layer", "head"), ctx), "D": (("layer", "head"), cov + ctx),
                     "S_bar_half": (("half", "layer", "head"), S[None] + noise)},
                    coords={"layer": np.arange(L), "head": np.arange(H), "half": [0, 1]})
    ds.attrs.update(model="m", revision="r")
    return ds


def _scores(L=3, H=4):
    z = np.zeros((L, H))
    ind = z.copy()
    ind[2, 1] = 0.9
    prev = z.copy()
    prev[0, 3] = 0.8
    return xr.Dataset({k: (("layer", "head"), v) for k, v in
                       (("induction", ind), ("previous_token", prev), ("duplicate_token", z), ("bos_sink", z))})


def test_heads_table_ranks_by_corpus_deviation_and_carries_the_scores():
    ds = _store()
    t = heads_table(ds, _scores())
    assert t["rank"].tolist() == list(range(1, 13))
    assert t["S_bar"].is_monotonic_decreasing
    best = ds["S_bar"].values.argmax()
    assert (t.loc[0, "layer"], t.loc[0, "head"]) == divmod(int(best), 4)
    row = t[t["head_label"] == "L2H1"].iloc[0]
    assert row["induction"] == 0.9 and row["S_bar"] == pytest.approx(float(ds["S_bar"].sel(layer=2, head=1)))
    top, bottom = top_bottom(t, 5, 3)
    assert len(top) == 5 and len(bottom) == 3
    assert bottom["S_bar"].is_monotonic_increasing and bottom.loc[0, "S_bar"] == t["S_bar"].min()
    roles = head_roles(t)
    assert set(roles[roles != ""]) == {"induction", "previous-token"}
    with pytest.raises(ValueError, match="different models"):
        heads_table(ds, _scores(4, 4))


def test_split_half_stability_spearman_and_shared_top():
    t = heads_table(_store())
    st = split_half_stability(t, top=4)
    assert st["n_heads"] == 12 and st["spearman"] > 0.9 and 3 <= st["top_shared"] <= 4
    # reversing one half's ranking gives a correlation of -1
    ds = _store()
    ds["S_bar_half"][1] = -ds["S_bar_half"][0]
    st = split_half_stability(heads_table(ds), top=4)
    assert st["spearman"] == pytest.approx(-1.0) and st["top_shared"] == 0


def test_ccmf_scatter_draws_every_head_at_its_meters(tmp_path, monkeypatch):
    from figure_data import capture, scatter

    figures = capture(monkeypatch)
    table = heads_table(_store(), _scores())
    pdf, png = ccmf_scatter(table, tmp_path / "scatter", top=3)
    assert pdf.stat().st_size > 0 and png.stat().st_size > 0 and len(figures) == 1
    # what is drawn: every head once at (M_cov, M_ctx), in the cloud of its role; the top 3 by S̄ labelled
    ax = figures[0].axes[0]
    clouds = scatter(ax)
    roles = head_roles(table)
    for name, pts in clouds.items():
        sel = (roles == ("" if name == "other" else name)).to_numpy()
        np.testing.assert_allclose(pts, table.loc[sel, ["M_cov", "M_ctx"]].to_numpy(float), rtol=1e-12)
    assert sum(len(v) for v in clouds.values()) == len(table)
    top = table.sort_values("rank").head(3)
    assert sorted(t.get_text() for t in ax.texts) == sorted(top["head_label"])
