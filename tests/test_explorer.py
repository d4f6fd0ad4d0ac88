"""The explorer (issue 61, mfpipe.explorer) on a small synthetic run: its pieces against direct computations, and the
site opened from disk in a real browser (Debian's Chromium; tests/browser.py) with corpus text that is markup: it
must show as text and run nothing. The ci run's explorer is opened in tests/test_workflow.py."""

import json

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from browser import broken_links, click_head, console_errors, grid_z, open_browser, open_model_page, set_revision, \
    wait_for
from synthetic_stats import BOS, VOCAB, make_store, windows

from mfpipe.corpus.tracked import TrackedSet
from mfpipe.explorer.assets import write_assets
from mfpipe.explorer.cards import kernel_block
from mfpipe.explorer.site import build_model, model_page

L, H = 2, 3
REVS, STEPS = ["step0", "step8"], [0, 8]
XSS = ['<img src=x onerror="window.__xss=1">', "<script>window.__xss=2</script>", "&amp; </div>"]
# next tokens pandas would read as missing: none after a window's last position (the lenses write ""), a token "null"
NEXT = {(0, 0): "", (0, 1): "null", (1, 0): "NA"}


def test_kernel_block_shows_the_most_frequent_queries_and_the_keys_they_attend_most():
    rng = np.random.default_rng(0)
    N, K = 6, 8
    P = rng.random((N, K))
    P /= P.sum(1, keepdims=True)
    nbar = rng.random((N, K)) + 0.5
    W = P / nbar
    W[2] = np.nan  # a type with no query: no row
    qc = np.array([5, 50, 100, 7, 30, 1])
    C = rng.integers(0, 100, (N, K))
    b = kernel_block(W, P, nbar, C, qc, [f"q{i}" for i in range(N)], [f"k{i}" for i in range(K)], k=3)
    assert b["query_index"] == [1, 4, 3]  # 100 has no row; then by count
    mass = P[[1, 4, 3]].mean(0)
    assert b["key_index"] == sorted(np.argsort(-mass)[:3].tolist())
    for i, q in enumerate(b["query_index"]):
        for j, k in enumerate(b["key_index"]):
            assert b["W"][i][j] == pytest.approx(W[q, k]) and b["P"][i][j] == pytest.approx(P[q, k])
            assert b["nbar"][i][j] == pytest.approx(nbar[q, k]) and b["C"][i][j] == C[q, k]
    assert b["query"] == ["q1", "q4", "q3"]


def _tracked(tokens):
    counts = np.bincount(tokens[:, 1:].ravel(), minlength=VOCAB)
    counts[BOS] = 0
    order = np.lexsort((np.arange(VOCAB), -counts))[:8]
    strings = [f"tok{i}" for i in order]
    strings[0], strings[1] = XSS[0], XSS[1]  # the two most frequent types: in every kernel heatmap
    return TrackedSet(type_ids=order, strings=strings, counts=counts[order], bos_id=BOS, vocab_size=VOCAB)


def _deviation(path, rev, rng):
    M_cov, M_ctx = rng.random((L, H)), rng.random((L, H))
    ds = xr.Dataset({"S_bar": (("layer", "head"), rng.random((L, H))), "M_cov": (("layer", "head"), M_cov),
                     "M_ctx": (("layer", "head"), M_ctx), "D": (("layer", "head"), M_cov + M_ctx)},
                    coords={"layer": np.arange(L), "head": np.arange(H)}, attrs={"model": "synth", "revision": rev})
    ds.to_zarr(path, zarr_format=3, consolidated=False)
    return ds


def _lens(path):
    rows = []
    for l in range(L):
        for h in range(H):
            toks = ["The", " cat", XSS[0], " sat", XSS[1], XSS[2]]
            rows.append(dict(layer=l, head=h, rank=0, D=0.5 + l, shard=0, window=l, position=3, S_bar=0.1, S_bar_rank=1,
                             head_D=0.2, head_M_cov=0.1, head_M_ctx=0.1, n_garbled=0, D_recomputed=0.5 + l, D_ok=True,
                             M_cov=0.3, M_ctx=0.2 + l, other_share=0.0, valid=True, left="The cat", query=XSS[0],
                             right=XSS[1], next_token=NEXT.get((l, h), XSS[2]), key_positions=json.dumps([1, 2]),
                             key_tokens=json.dumps(XSS[:2]), key_shares=json.dumps([0.6, 0.3]),
                             decode_ids=json.dumps([1, 2]), decode_tokens=json.dumps(XSS[1:3]),
                             decode_probs=json.dumps([0.2, 0.1]), query_index=2, excerpt_tokens=json.dumps(toks),
                             excerpt_attention=json.dumps([0.1, 0.2, 0.4, 0.0, 0.0, 0.0]), bos_share=0.3))
    pd.DataFrame(rows).to_csv(path, index=False)


@pytest.fixture(scope="module")
def synthetic_site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explorer")
    rng = np.random.default_rng(1)
    tokens = windows(24)
    tracked = _tracked(tokens)
    files = {"stats": {}, "deviation": {}, "head_scores": {}}
    dev = {}
    for rev in REVS:
        U = rng.random((L, H, 8, 10))
        files["stats"][rev] = str(make_store(tmp / rev / "stats.zarr", tokens, tracked, U, revision=rev))
        dev[rev] = _deviation(tmp / rev / "deviation.zarr", rev, rng)
        files["deviation"][rev] = str(tmp / rev / "deviation.zarr")
        hs = pd.DataFrame([dict(model="synth", revision=rev, layer=l, head=h, head_label=f"L{l}H{h}",
                                induction=rng.random(), previous_token=rng.random(), duplicate_token=rng.random(),
                                bos_sink=rng.random()) for l in range(L) for h in range(H)])
        files["head_scores"][rev] = str(tmp / f"head_scores_{rev}.csv")
        hs.to_csv(files["head_scores"][rev], index=False)
    sub = pd.DataFrame([dict(revision=r, step=s, layer=l, head=h, deviation=rng.random())
                        for r, s in zip(REVS, STEPS) for l in range(L) for h in range(H)])
    files["substitution_heads"] = str(tmp / "substitution_heads_synth.csv")
    sub.to_csv(files["substitution_heads"], index=False)
    _lens(tmp / "contexts.csv")
    files["lenses"] = {"step8": str(tmp / "contexts.csv")}
    site = tmp / "site"
    write_assets(site / "assets")
    build_model(site / "synth" / "data", files, model="synth", revisions=REVS, steps=STEPS,
                rollout_revisions=["step8"], induction_window=[2, 6], top_types=4)
    (site / "synth" / "index.html").write_text(model_page("synth"))
    return site, dev, sub, files


def test_cards_hold_the_stores_and_tables_values(synthetic_site):
    site, dev, sub, files = synthetic_site
    from mfpipe.stats.api import open_stats

    card = json.loads((site / "synth/data/cards/step0/L1H2.js").read_text()[len("MFX.card("):-3])
    assert card["scores"]["S_bar"]["value"] == pytest.approx(float(dev["step0"]["S_bar"][1, 2]))
    want = sub[(sub["revision"] == "step0") & (sub["layer"] == 1) & (sub["head"] == 2)]["deviation"].item()
    assert card["scores"]["substitution_D"]["value"] == pytest.approx(want)
    rank = int((dev["step0"]["S_bar"].values > float(dev["step0"]["S_bar"][1, 2])).sum()) + 1
    assert card["scores"]["S_bar"]["rank"] == rank
    k = card["kernel"]
    s = open_stats(files["stats"]["step0"])
    W, P = s.W(layer=1).values[2], s.P(layer=1).values[2]
    for i, q in enumerate(k["query_index"]):
        for j, c in enumerate(k["key_index"]):
            assert k["W"][i][j] == pytest.approx(W[q, c]) and k["P"][i][j] == pytest.approx(P[q, c])
    assert XSS[0] in k["query"]  # the markup type string is in the card, as a string
    assert card["contexts"] == [] and not card["contexts_mined"]  # contexts only where the lenses ran
    for (l, h), tok in {**NEXT, (1, 2): XSS[2]}.items():  # the token strings as the lenses wrote them, none "nan"
        mined = json.loads((site / f"synth/data/cards/step8/L{l}H{h}.js").read_text()[len("MFX.card("):-3])
        assert [c["next_token"] for c in mined["contexts"]] == [tok]


def test_the_site_in_a_browser_shows_markup_from_the_corpus_as_text_and_runs_none(synthetic_site, tmp_path):
    site, dev, sub, _ = synthetic_site
    d = open_browser(tmp_path)
    try:
        open_model_page(d, site / "synth" / "index.html")
        assert np.allclose(np.array(grid_z(d), float), dev["step8"]["S_bar"].values)  # the last revision first
        set_revision(d, 0)
        assert np.allclose(np.array(grid_z(d), float), dev["step0"]["S_bar"].values)
        set_revision(d, 1)
        click_head(d, 1, 2)
        ctx = wait_for(d, "document.querySelector('#contexts .context')")
        text = ctx.text
        for x in XSS:
            assert x in d.execute_script("return document.getElementById('contexts').textContent;")
        assert "The" in text
        # nothing the corpus held ran or became an element
        assert d.execute_script("return window.__xss === undefined;")
        assert not d.find_elements("css selector", "#card img, #card script")
        assert d.execute_script("return document.querySelector('#contexts .tok.query').textContent;") == XSS[0]
        kernel_labels = d.execute_script("return Array.from(document.querySelectorAll('#kernel .ytick text'))"
                                         ".map(t => t.textContent);")
        assert XSS[0] in kernel_labels and not d.find_elements("css selector", "#kernel img")
        hrefs = d.execute_script("return Array.from(document.querySelectorAll('#card a')).map(a => a.getAttribute('href'));")
        assert hrefs and not broken_links(site / "synth" / "index.html", hrefs)
        assert console_errors(d) == []
    finally:
        d.quit()
