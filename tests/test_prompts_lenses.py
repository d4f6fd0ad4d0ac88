"""The lenses of App. P (issue 11 item 7) on tiny random models (GPT-2 and one rotary architecture): the contexts
mined from the pass-2 store, their D recomputed against the stored top_D, the logit-lens decode of the deviation
vector against a plain torch computation, App. P's filters (garbled text, attention on <other> keys) and the
Markdown / HTML writers' escaping. The tokenizer is a stub mapping ids to strings (no download)."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import torch
from hf_reference import final_norm, head_maps
from stats_reference import reference_capture, tiny_stats_half
from tiny_models import TINY_MODEL_TYPES, make_tiny_model

from mfpipe.experiments.prompts import lenses as LE
from mfpipe.deviation import shards as DP
from mfpipe.meanfield.kernel import MeanFieldKernel, kernel_from_store
from mfpipe.models.adapters import get_adapter

N_WIN = 24
TOP_K = 8


class StubTokenizer:
    """ids -> strings (`` w<id>`` unless overridden); decode concatenates, as a byte-level BPE decode does."""

    def __init__(self, vocab: int = 128, special: dict | None = None):
        self.strings = {i: f" w{i}" for i in range(vocab)}
        self.strings.update(special or {})

    def decode(self, ids):
        return "".join(self.strings[int(i)] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.strings[int(i)] for i in ids]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _window(setup, r) -> np.ndarray:
    """The tokens of a row's window (shard 0: windows 0..9, shard 1: 10..)."""
    return setup["tokens"][(10 if int(r["shard"]) == 1 else 0) + int(r["window"])]


def _pass2(model, ad, tokens, doc_ids, tracked, st, **kw):
    sums, meta = DP.deviation_shard(model, ad, tokens, doc_ids, tracked, st, min_count=1, batch_size=5,
                                    progress=False, top_k=TOP_K, **kw)
    return DP.deviation_dataset(sums, meta, tracked, min_occurrences=3)


@pytest.fixture(scope="module", params=("gpt2", "llama"))
def setup(request, tmp_path_factory):
    mt = request.param
    tmp = tmp_path_factory.mktemp(f"lens-{mt}")
    model, ad, tokens, tracked, sums, meta, st = tiny_stats_half(mt, tmp, model_seed=7, n_windows=N_WIN, token_seed=3,
                                                                 batch_size=6)
    doc_ids = np.repeat(np.arange(N_WIN)[:, None] // 3, tokens.shape[1], axis=1)
    ds = _pass2(model, ad, tokens, doc_ids, tracked, st)
    # the statistics half as two shard files (the store's top_shard indexes this sorted list)
    shard_paths = []
    for i, sl in enumerate((slice(0, 10), slice(10, None))):
        p = tmp / f"shard-{i:05d}.npz"
        np.savez(p, tokens=tokens[sl], doc_ids=doc_ids[sl])
        shard_paths.append(p)
    parts = [DP.deviation_shard(model, ad, tokens[sl], doc_ids[sl], tracked, st, min_count=1, batch_size=5,
                                progress=False, top_k=TOP_K) for sl in (slice(0, 10), slice(10, None))]
    merged = DP.deviation_dataset(*DP.merge_partials(parts), tracked, min_occurrences=3)
    kernel = kernel_from_store(st, tracked, min_count=1)
    tok = StubTokenizer()
    S = merged["S_bar"].values
    named = [(0, int(np.argmax(S[0])))]  # the top heads are in layer 1: name one of layer 0 as well
    rows = LE.mine_contexts(merged, shard_paths, heads=named, per_head=6, n_lens_heads=3, tokenizer=tok)
    df = LE.context_details(ad, kernel, tok, shard_paths, rows, k_keys=3, decode_k=5, batch_size=4)
    return dict(mt=mt, model=model, ad=ad, tokens=tokens, doc_ids=doc_ids, tracked=tracked, st=st, ds=ds,
                merged=merged, shards=shard_paths, kernel=kernel, tok=tok, rows=rows, df=df, named=named)


def test_mined_heads_and_rows(setup):
    ds, rows = setup["merged"], setup["rows"]
    S = ds["S_bar"].values
    order = sorted(((l, h) for l, h in np.ndindex(S.shape)), key=lambda lh: -S[lh])
    want = list(dict.fromkeys(order[:3] + setup["named"]))
    assert list(dict.fromkeys(zip(rows["layer"], rows["head"]))) == want and len(want) == 4
    assert (rows.groupby(["layer", "head"]).size() == 6).all()
    for (l, h), g in rows.groupby(["layer", "head"]):  # the store's best contexts, highest D first
        np.testing.assert_array_equal(g["D"].to_numpy(), ds["top_D"].values[l, h, :6])
        assert (g["S_bar_rank"] == order.index((l, h)) + 1).all()
    # named heads join the default selection once, in the order given
    extra = order[-1]
    more = LE.mine_contexts(ds, setup["shards"], heads=[f"L{extra[0]}H{extra[1]}", order[0]], per_head=2, n_lens_heads=2)
    assert list(dict.fromkeys(zip(more["layer"], more["head"]))) == order[:2] + [extra]
    with pytest.raises(ValueError, match="L<layer>H<head>"):
        LE.parse_heads(["layer 3"])


def test_recomputed_D_equals_stored_top_D(setup):
    """Acceptance: re-running the windows gives the stored D of every mined context (1e-5), in both layers; a
    kernel other than pass 2's is caught by the flag."""
    df = setup["df"]
    assert len(df) == 24 and df["valid"].all() and set(df["layer"]) == {0, 1}
    np.testing.assert_allclose(df["D_recomputed"], df["D"], rtol=0, atol=1e-5)
    assert df["D_ok"].all()
    np.testing.assert_allclose(df["M_cov"] + df["M_ctx"], df["D_recomputed"], atol=1e-6)
    k = setup["kernel"]
    wrong = MeanFieldKernel(k.W, k.mu * 1.3 + 0.05, k.key_lut, k.query_lut, k.n, dict(k.attrs))
    bad = LE.context_details(setup["ad"], wrong, setup["tok"], setup["shards"], setup["rows"].iloc[:6])
    assert not bad["D_ok"].all()


def _zhat_by_hand(tokens_row, j, l, h, kernel):
    """ẑ of one context by a loop over the prefix's key types (eq:ccmf), float64."""
    W, mu = kernel.W.double().numpy(), kernel.mu.double().numpy()
    s = int(kernel.query_lut[tokens_row[j]])
    bk = [kernel.n] + [int(kernel.key_lut[t]) for t in tokens_row[1 : j + 1]]
    nx = sum(W[l, h, s, t] for t in bk)
    return sum(W[l, h, s, t] * mu[l, h, t] for t in bk) / nx


def test_logit_lens_decode_equals_plain_torch(setup):
    """Acceptance: the decode equals softmax(lm_head(final_norm((z − ẑ) O_h))) computed from the HF modules, with
    z from torch hooks and ẑ by a loop, on one row of each layer."""
    df, model, kernel = setup["df"], setup["model"], setup["kernel"]
    for l in (0, 1):
        r = df[df["layer"] == l].iloc[0]
        row, j, h = _window(setup, r), int(r["position"]), int(r["head"])
        ref = reference_capture(model, torch.as_tensor(row[None].astype(np.int64)))
        z = ref["reads"][l, 0, j, h]
        delta = (z - _zhat_by_hand(row, j, l, h, kernel)) @ head_maps(model, l)[h]
        with torch.no_grad():
            logits = model.lm_head(final_norm(model)(torch.as_tensor(delta, dtype=torch.float32)))
        p = torch.softmax(logits.double(), -1)
        want_p, want_i = p.topk(5)
        assert r["decode_ids"] == want_i.tolist()
        np.testing.assert_allclose(r["decode_probs"], want_p.numpy(), rtol=1e-4, atol=1e-6)
        assert r["decode_tokens"] == [f" w{i}" for i in want_i.tolist()]
        # the top keys are the head's largest attention weights in the same hooks
        att = ref["probs"][l, 0, h, j]
        np.testing.assert_array_equal(r["key_positions"], np.argsort(-att, kind="stable")[:3])
        np.testing.assert_allclose(r["key_shares"], np.sort(att)[::-1][:3], atol=1e-6)
        assert r["next_token"] == (f" w{row[j + 1]}" if j + 1 < len(row) else "")


def _other_share_by_hand(setup, df):
    """Attention on untracked keys (positions >= 1 whose type is not in the tracked set), from torch hooks."""
    tracked_ids = set(setup["tracked"].type_ids.tolist())
    out = []
    for _, r in df.iterrows():
        row = _window(setup, r)
        ref = reference_capture(setup["model"], torch.as_tensor(row[None].astype(np.int64)))
        l, h, j = (int(r[k]) for k in ("layer", "head", "position"))
        att = ref["probs"][l, 0, h, j]
        out.append(sum(att[i] for i in range(1, j + 1) if int(row[i]) not in tracked_ids))
    return np.asarray(out)


def test_mined_contexts_respect_the_other_share_filter(setup):
    """App. P's filter: no mined context puts more than 10% of the head's attention on <other> keys (recomputed by
    hand); without the filter in pass 2 some top contexts would (so the check is not vacuous)."""
    df = setup["df"]
    by_hand = _other_share_by_hand(setup, df)
    np.testing.assert_allclose(df["other_share"], by_hand, atol=1e-6)
    assert (by_hand <= 0.10 + 1e-9).all()
    loose = _pass2(setup["model"], setup["ad"], setup["tokens"], setup["doc_ids"], setup["tracked"], setup["st"],
                   other_share_max=1.0)
    rows = LE.mine_contexts(loose, [setup["tokens"]], heads=setup["named"], per_head=TOP_K, n_lens_heads=4)
    unfiltered = LE.context_details(setup["ad"], setup["kernel"], setup["tok"], [setup["tokens"]], rows)
    assert unfiltered["D_ok"].all()
    assert (unfiltered["other_share"] > 0.10).any()


def test_garbled_windows_are_dropped(setup):
    """App. P's second filter: a context whose excerpt decodes to garbled text (U+FFFD, control characters) is
    dropped and the next recorded context takes its place; the others stay."""
    ds, shards, clean = setup["merged"], setup["shards"], setup["rows"]
    win = LE.window_tokens(shards, clean)
    assert (win == np.stack([_window(setup, r) for _, r in clean.iterrows()])).all()
    pos = clean["position"].to_numpy()
    g = int(win[0, pos[0]])  # the query token of the best context of the top head
    bad = StubTokenizer(special={g: " \ufffd", int(win[1, pos[1]]): "\x07"})
    mined = LE.mine_contexts(ds, shards, heads=setup["named"], per_head=6, n_lens_heads=3, tokenizer=bad)
    assert mined["n_garbled"].max() > 0
    mwin = LE.window_tokens(shards, mined)
    for n, r in enumerate(mined.itertuples()):
        assert not LE.is_garbled(LE._excerpt(bad, mwin[n], r.position, LE.BEFORE, LE.AFTER)[3])
    key = lambda d: set(zip(d["layer"], d["head"], d["rank"]))  # noqa: E731
    gone = key(clean) - key(mined)
    assert next(clean.itertuples())[1:4] in gone
    for n, r in enumerate(clean.itertuples()):  # only garbled ones went
        if (r.layer, r.head, r.rank) in gone:
            assert LE.is_garbled(LE._excerpt(bad, win[n], r.position, LE.BEFORE, LE.AFTER)[3])
    assert (mined.groupby(["layer", "head"]).size() <= 6).all()
    assert LE.is_garbled("ab\ufffd") and LE.is_garbled("a\x1bb") and LE.is_garbled("\ue000")
    assert not LE.is_garbled(" naïve\n\tcafé — 東京")


class ByteTokenizer:
    """One token per byte (id = byte + 1, 0 = BOS), decoded as UTF-8 with replacement, as a byte-level BPE does."""

    def decode(self, ids):
        return bytes(int(i) - 1 for i in ids if int(i) > 0).decode("utf-8", errors="replace")


def test_excerpt_keeps_split_characters_whole():
    tok = ByteTokenizer()
    ids = np.array([0] + [b + 1 for b in "xx naïve ok".encode()])
    i1 = 1 + "xx na".encode().__len__()  # the two bytes of ï are tokens i1 and i1 + 1
    for q, after in ((i1, "ve"), (i1 + 1, "ve ")):  # 3 tokens after the query
        assert LE._excerpt(tok, ids, q, 24, 3) == ("xx na", "ï", after, "xx naï" + after)
    # an excerpt that starts inside ï: the cut character is dropped, the rest is not garbled
    left, query, right, text = LE._excerpt(tok, ids, i1 + 3, 2, 1)
    assert (left, query, right) == ("…v", "e", " ") and not LE.is_garbled(text)
    # an invalid byte inside the excerpt is garbled text
    bad = ids.copy()
    bad[3] = 0xFF + 1
    assert LE.is_garbled(LE._excerpt(tok, bad, i1 + 3, 24, 3)[3])


def test_markdown_and_html_escape_token_text(setup):
    df = setup["df"].copy()
    df.loc[0, ["left", "query", "right"]] = ["a|b\nc", "*q_", "<x> & `y`"]
    df.at[0, "key_tokens"] = ["k|", "\n"] + list(df.at[0, "key_tokens"][2:])
    df.at[0, "decode_tokens"] = ["[d]"] + list(df.at[0, "decode_tokens"][1:])
    md = LE.contexts_markdown(df, "tiny", "r1")
    assert "a\\|b⏎c«\\*q\\_»&lt;x&gt; &amp; \\`y\\`" in md and "k\\| (" in md and "⏎ (" in md and "\\[d\\]" in md
    heads = df.groupby(["layer", "head"], sort=False).ngroups
    assert md.count("\n## L") == heads and "## L{}H{} — S̄=".format(*df.iloc[0][["layer", "head"]]) in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == heads * 2 + len(df)
    for line in table:  # every row has exactly the 8 columns: no unescaped | or newline inside a cell
        assert len(re.findall(r"(?<!\\)\|", line)) == 9, line
    dmd = LE.decode_markdown(df, "tiny", "r1")
    assert "\\*q\\_" in dmd and dmd.count("\n## L") == heads
    # the filter the preamble names is the one pass 2 mined with (its store's other_share_max), not a fixed 10%
    assert "more than 10% of its attention" in md
    for page in (LE.contexts_markdown(df, "tiny", "r1", 0.25), LE.decode_markdown(df, "tiny", "r1", 0.25),
                 LE.contexts_html(df, "tiny", "r1", 0.25)):
        assert "more than 25% of its attention" in page and "10%" not in page
    for line in (x for x in dmd.splitlines() if x.startswith("|")):
        assert len(re.findall(r"(?<!\\)\|", line)) == 6, line
    page = LE.contexts_html(df, "tiny", "r1")
    assert "a|b⏎c<mark>*q_</mark>&lt;x&gt; &amp; `y`" in page and "<x>" not in page
    back = pd.read_csv(__import__("io").StringIO(LE.contexts_csv(df)))
    assert len(back) == len(df) and back.loc[0, "left"] == "a|b\nc"


@pytest.mark.parametrize("mt", TINY_MODEL_TYPES)
def test_unembed_is_the_models_own_lm_head(mt):
    """Adapter.unembed(final residual) equals the model's logits (final norm, LM head, Gemma-2's soft cap)."""
    model = make_tiny_model(mt, seed=1, **({"final_logit_softcapping": 2.0} if mt == "gemma2" else {}))
    ad = get_adapter(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = {}
    res = ad.run(ids, select=(), on_final=lambda x: seen.setdefault("final", x.clone()), logits=True)
    np.testing.assert_allclose(ad.unembed(seen["final"]), res.logits, atol=1e-5, rtol=1e-5)
    if mt == "gemma2":
        assert res.logits.abs().max() <= 2.0


def test_jlens_decode_columns(setup):
    """With the model's J-lens store, context_details adds the J-lens decode softmax(lm_head(final_norm(J_ℓ Δ O_h)))
    (the attn point of the row's layer) beside the unchanged raw decode, checked against plain torch on one row of
    each layer; with J = I at the attn points the two decodes coincide; the writers show both."""
    from mfpipe.jlens import lens as JL

    df0, model, kernel, ad = setup["df"], setup["model"], setup["kernel"], setup["ad"]
    J = JL.estimate_jlens(ad, setup["tokens"], n_positions=8, seed=0, batch_size=4, progress=False)
    rows = setup["rows"]
    df = LE.context_details(ad, kernel, setup["tok"], setup["shards"], rows, k_keys=3, decode_k=5, batch_size=4,
                            jlens=J)
    for c in ("decode_ids", "decode_tokens", "decode_probs", "D_recomputed"):
        assert df[c].tolist() == df0[c].tolist(), c
    assert all(len(x) == 5 for x in df["jlens_ids"]) and df["jlens_tokens"].iloc[0][0].startswith(" w")
    for l in (0, 1):
        r = df[df["layer"] == l].iloc[0]
        row, j, h = _window(setup, r), int(r["position"]), int(r["head"])
        ref = reference_capture(model, torch.as_tensor(row[None].astype(np.int64)))
        delta = (ref["reads"][l, 0, j, h] - _zhat_by_hand(row, j, l, h, kernel)) @ head_maps(model, l)[h]
        Jd = J["J"].sel(point="attn", layer=l).values.astype(np.float64) @ delta
        with torch.no_grad():
            logits = model.lm_head(final_norm(model)(torch.as_tensor(Jd, dtype=torch.float32)))
        want_p, want_i = torch.softmax(logits.double(), -1).topk(5)
        assert r["jlens_ids"] == want_i.tolist()
        np.testing.assert_allclose(r["jlens_probs"], want_p.numpy(), rtol=1e-4, atol=1e-6)
    eye = J.copy(deep=True)
    eye["J"].loc[dict(point="attn", layer=[0, 1])] = np.eye(ad.d_model, dtype=np.float32)
    same = LE.context_details(ad, kernel, setup["tok"], setup["shards"], rows.iloc[:6], jlens=eye)
    assert same["jlens_ids"].tolist() == same["decode_ids"].tolist()
    np.testing.assert_allclose(np.stack(same["jlens_probs"]), np.stack(same["decode_probs"]), rtol=0, atol=1e-7)
    md = LE.contexts_markdown(df, "tiny", "r1")
    assert "J-lens decode of Δ" in md and "final_norm(J_ℓ Δ O_h)" in md and "not applied" not in md
    for line in (x for x in md.splitlines() if x.startswith("|")):  # 9 columns with the J-lens
        assert len(re.findall(r"(?<!\\)\|", line)) == 10, line
    dmd = LE.decode_markdown(df, "tiny", "r1")
    assert "Tokens in more than one J-lens decode" in dmd and "| J-lens decode (softmax probability) |" in dmd
    for line in (x for x in dmd.splitlines() if x.startswith("|")):
        assert len(re.findall(r"(?<!\\)\|", line)) == 7, line
    assert "<th>J-lens decode of Δ</th>" in LE.contexts_html(df, "tiny", "r1")
    back = pd.read_csv(__import__("io").StringIO(LE.contexts_csv(df)))
    assert "jlens_tokens" in back and "decode_tokens" in back
    assert "not applied" in LE.contexts_markdown(df0, "tiny", "r1")  # without a store: the raw lens only


def test_jlens_decode_through_products_equals_the_store(setup):
    """Issue 58: the lenses through Jacobian-vector products on the store's sample (jlens.decode: jvp) give the
    same J-lens columns as through the stored J (the same top tokens; probabilities within 1e-5), every other column
    unchanged."""
    from mfpipe.jlens import lens as JL
    from mfpipe.jlens.jvp import JLensSample

    ad, kernel, rows = setup["ad"], setup["kernel"], setup["rows"]
    J = JL.estimate_jlens(ad, setup["tokens"], n_positions=8, seed=0, batch_size=4, progress=False)
    kw = dict(k_keys=3, decode_k=5, batch_size=4)
    store = LE.context_details(ad, kernel, setup["tok"], setup["shards"], rows, jlens=J, **kw)
    sample = JLensSample(setup["tokens"], n_positions=8, seed=0, batch_size=4, chunk=7)
    products = LE.context_details(ad, kernel, setup["tok"], setup["shards"], rows, jlens=sample, **kw)
    assert list(products.columns) == list(store.columns)
    for c in store.columns:
        if c != "jlens_probs":
            assert products[c].tolist() == store[c].tolist(), c
    np.testing.assert_allclose(np.stack(products["jlens_probs"]), np.stack(store["jlens_probs"]), rtol=0, atol=1e-5)
