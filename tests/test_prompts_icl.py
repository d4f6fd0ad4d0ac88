"""Mean-field deviation and in-context learning (issue 11 items 5-6, paper Sec. 6.1-6.2, App. O): the prompt
classes, the per-prompt meters against the pass-2 math by hand on an independent HF/torch-hook reference, ΔL and
ΔL_perm against plain forwards with torch hooks, the permutation checks, the class-separation statistics against a
hand-computed example, and the instance meter on [c; c] against per-prefix measurements."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from figure_data import capture, lines, main_axes, scatter
from hf_reference import head_maps, patched_reads
from meanfield_reference import slow_zhat
from stats_reference import reference_capture, tracked_for, zipf_windows
from tiny_models import make_tiny_model

from mfpipe.experiments.prompts import classes as I
from mfpipe.experiments.prompts import figures as PF
from mfpipe.experiments.prompts import meter as IM
from mfpipe.experiments.prompts import sets as P
from mfpipe.meanfield.kernel import MeanFieldKernel, kernel_from_store
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

T_CTX = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _store(model, ad, tokens, tracked, path):
    sums = accumulate_shard(model, ad, tokens, tracked, batch_size=8, device="cpu", progress=False)
    meta = {"model": "tiny", "revision": "r1", "half": "stats", "corpus": "zipf", "corpus_fingerprint": "fp",
            "model_type": ad.model_type}
    return open_stats(write_store(finalize(sums, tracked, meta), path))


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def setup(request, tmp_path_factory):
    mt = request.param
    model = make_tiny_model(mt, seed=5)
    ad = get_adapter(model)
    allw = zipf_windows(36, T=T_CTX, seed=1)  # one vocabulary permutation: the eval windows share the frequent types
    st_tok, ev = allw[:24], allw[24:]
    tracked = tracked_for(st_tok)
    st = _store(model, ad, st_tok, tracked, tmp_path_factory.mktemp(f"icl-{mt}") / "stats.zarr")
    kernel = kernel_from_store(st, tracked, min_count=1)
    doc = np.repeat((np.arange(len(ev)) // 2)[:, None], T_CTX, axis=1)  # documents of two windows
    return mt, model, ad, tracked, kernel, ev, doc


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A tiny byte-level BPE (the mini suite's recipe) trained offline on a few sentences."""
    from transformers import AutoTokenizer

    from mfpipe.minisuite.tokenizer import train_tokenizer

    words = ("hot cold big small red blue green cat dog sun moon tree house water fire light dark fast slow good bad "
             "the and you she").split()
    texts = []
    for i in range(40):
        j = (i * 3) % len(words)
        texts.append(" ".join(words[j:] + words[:j]) + ".")
        texts.append("\n".join(f"{w}:{w.capitalize()}" for w in words[i % 7 :: 3]))
        texts.append("one two three four five six seven eight nine ten a b c d e f g 0 1 2 3 4 5 6 7 8 9")
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 400, 2, out)
    return AutoTokenizer.from_pretrained(str(out)), texts


# ------------------------------------------------------------------ prompt classes
def test_induction_and_random_prompts_have_the_documented_shape_and_targets():
    pool = np.arange(10, 60)
    ind, rnd = P.induction_and_random_prompts(pool, 99, 40, 25, seed=3)
    assert len(ind) == len(rnd) == 25
    ms = set()
    for a, b in zip(ind, rnd):
        k, m = a.meta["n_random"], a.meta["repeat"]
        ms.add(m)
        assert k == 12 and 2 <= m <= k - 1 and len(a) == 1 + k + m <= 40
        r = a.tokens[1 : 1 + k]
        assert a.tokens[0] == 99 and len(set(r.tolist())) == k and np.isin(r, pool).all()
        np.testing.assert_array_equal(a.tokens[1 + k :], r[:m])
        first = int(np.flatnonzero(a.tokens == a.query)[0])  # the query's first occurrence
        assert first < 1 + k and a.target == a.tokens[first + 1]
        # the matched control: the same sequence cut in the first copy at the same query
        np.testing.assert_array_equal(b.tokens, a.tokens[: 1 + m])
        assert b.query == a.query and b.target == a.target and (b.tokens == b.query).sum() == 1
        assert len(b) - 1 <= k
    assert len(ms) > 3  # random-length repeats
    ind2, _ = P.induction_and_random_prompts(pool, 99, 40, 25, seed=3)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(ind, ind2))
    ind3, _ = P.induction_and_random_prompts(pool, 99, 40, 25, seed=4)
    assert not all(np.array_equal(x.tokens, y.tokens) for x, y in zip(ind, ind3))
    # n_random is cut to fit the context length (2k <= T)
    short, _ = P.induction_and_random_prompts(pool, 99, 10, 5, seed=0)
    assert all(p.meta["n_random"] == 5 and len(p) <= 10 for p in short)


def test_natural_prompts_end_on_a_query_type_one_per_document():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 30, size=(40, 20))
    tokens[:, 0] = 99
    doc = np.repeat((np.arange(40) // 4)[:, None], 20, axis=1)  # 10 documents of 4 windows
    doc[5, 10:] += 100  # a window whose last part is another document
    q = np.arange(0, 15)
    got = P.natural_prompts(tokens, doc, q, 100, length=12, seed=1)
    want_docs = {int(doc[w, 11]) for w in range(40) if tokens[w, 11] in q and doc[w, 11] == doc[w, 12]}
    assert len(got) == len(want_docs) and {p.meta["document"] for p in got} == want_docs
    for p in got:
        w = p.meta["window"]
        assert len(p) == 12 and p.query in q and p.tokens[0] == 99
        np.testing.assert_array_equal(p.tokens, tokens[w, :12])
        assert p.target == tokens[w, 12] and doc[w, 11] == doc[w, 12]
    assert len(P.natural_prompts(tokens, doc, q, 3, length=12, seed=1)) == 3
    default = P.natural_prompts(tokens, doc, q, 2, seed=1)
    assert all(len(p) == 19 for p in default)


def test_fewshot_prompts_round_trip_through_the_tokenizer(tokenizer, tmp_path):
    tok, _ = tokenizer
    strings = [tok.decode([i]) for i in range(len(tok))]
    tasks = {t.name: t for t in P.builtin_tasks(tok, strings)}
    assert set(tasks) == {"capitalisation", "copying", "successor"}
    assert all(y == x.capitalize() and y != x for x, y in tasks["capitalisation"].pairs)
    assert all(x == y for x, y in tasks["copying"].pairs)
    assert ("one", "two") in tasks["successor"].pairs and ("a", "b") in tasks["successor"].pairs
    task_file = tmp_path / "antonym.json"
    pairs = [["hot", "cold"], ["big", "small"], ["good", "bad"], ["fast", "slow"], ["light", "dark"], ["sun", "moon"],
             ["cold", "hot"]]
    task_file.write_text(json.dumps({"name": "antonym", "pairs": pairs}))
    user = P.load_task_file(task_file)
    assert user.name == "antonym" and user.pairs[0] == ("hot", "cold")
    bos, colon = tok.bos_token_id, tok(":", add_special_tokens=False)["input_ids"]
    assert len(colon) == 1
    prompts = P.fewshot_prompts(tok, list(tasks.values()) + [user], bos, 64, 16, seed=0)
    assert len(prompts) == 16 and {p.task for p in prompts} == set(tasks) | {"antonym"}
    rules = {"capitalisation": str.capitalize, "copying": lambda x: x}
    for p in prompts:
        text = p.meta["text"]
        assert p.tokens[0] == bos and p.query == colon[0] and len(p) <= 64
        assert tok.decode(p.tokens[1:].tolist()) == text  # the prompt is the documented text
        lines = text.split("\n")
        assert len(lines) == P.N_EXEMPLARS + 1 and lines[-1].endswith(":")
        ex = [tuple(line.split(":")) for line in lines[:-1]]
        xq = lines[-1][:-1]
        assert xq not in [x for x, _ in ex]  # held out
        if p.task in rules:
            assert all(y == rules[p.task](x) for x, y in ex) and p.meta["answer"] == rules[p.task](xq)
        elif p.task == "antonym":
            assert all(list(e) in pairs for e in ex)
        full = tok(text + p.meta["answer"], add_special_tokens=False)["input_ids"]
        assert full[: len(p) - 1] == p.tokens[1:].tolist() and full[len(p) - 1] == p.target
    # the successor task draws within one family
    for p in prompts:
        if p.task == "successor":
            xs = [line.split(":")[0] for line in p.meta["text"].split("\n")]
            kinds = {"d" if x.isdigit() else ("l" if len(x) == 1 else "w") for x in xs}
            assert len(kinds) == 1
    for bad in ({"pairs": pairs}, {"name": "x", "pairs": pairs[:3]}, {"name": "x", "pairs": [["a", 1]] * 6}):
        task_file.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="task file"):
            P.load_task_file(task_file)


# ------------------------------------------------------------------ per-prompt measurement
def _prompts(setup, n=6):
    mt, model, ad, tracked, kernel, ev, doc = setup
    pool = I.queryable_types(kernel)
    ind, rnd = P.induction_and_random_prompts(pool, tracked.bos_id, T_CTX, n, n_random=8, seed=0)
    nat = P.natural_prompts(ev, doc, pool, n, length=20, seed=0)
    assert len(nat) >= 3
    return ind + nat + rnd


def hand_meters(model, tokens, kernel):
    """D, M_cov, M_ctx at the last position of one prompt, averaged over layers and heads: the pass-2 formulas by
    loops over the prefix's key types on the HF/torch-hook reference (float64, residual units through O_h)."""
    ref = reference_capture(model, torch.as_tensor(tokens[None].astype(np.int64)))
    W, mu = kernel.W.double().numpy(), kernel.mu.double().numpy()
    L, H, N, K = W.shape
    j = len(tokens) - 1
    s = int(kernel.query_lut[tokens[j]])
    bk = [N] + [int(kernel.key_lut[t]) for t in tokens[1 : j + 1]]
    out = np.zeros((3, L, H))
    for l in range(L):
        O = head_maps(model, l)
        for h in range(H):
            p, v = ref["probs"][l, 0, h, j, : j + 1], ref["values"][l, 0, h, : j + 1]
            nx = sum(bk.count(t) * W[l, h, s, t] for t in set(bk))
            zhat, mixed = np.zeros(v.shape[1]), np.zeros(v.shape[1])
            for t in set(bk):
                msk = np.array([b == t for b in bk])
                A_t = p[msk].sum()
                Ahat = bk.count(t) * W[l, h, s, t] / nx
                zhat += Ahat * mu[l, h, t]
                mixed += Ahat * (p[msk, None] * v[msk]).sum(0) / A_t
            zr, hr, xr = ref["reads"][l, 0, j, h] @ O[h], zhat @ O[h], mixed @ O[h]
            D = 1 - zr @ hr / np.sqrt((zr @ zr) * (hr @ hr))
            e = zr - hr
            ep = e - (e @ hr) / (hr @ hr) * hr
            out[:, l, h] = D, (zr - xr) @ ep / (ep @ ep) * D, (xr - hr) @ ep / (ep @ ep) * D
    return out.mean((1, 2))


def test_meters_at_the_query_equal_the_pass2_math_by_hand(setup):
    """Acceptance: per-prompt D_MF, M_cov, M_ctx equal the pass-2 formulas applied by hand (1e-5), and
    M_cov + M_ctx = D_MF (1e-6), on every prompt class."""
    mt, model, ad, tracked, kernel, ev, doc = setup
    prompts = _prompts(setup)
    df, skipped = I.measure_prompts(ad, kernel, prompts, batch_size=4)
    assert len(df) + sum(skipped.values()) == len(prompts) and len(df) >= len(prompts) - 2
    np.testing.assert_allclose(df["M_cov"] + df["M_ctx"], df["D_MF"], atol=1e-6)
    for cls in ("induction", "natural", "random"):
        row = df[df["cls"] == cls].iloc[-1]
        want = hand_meters(model, prompts[int(row["prompt"])].tokens, kernel)
        np.testing.assert_allclose(row[["D_MF", "M_cov", "M_ctx"]].to_numpy(float), want, atol=1e-5, err_msg=cls)
    assert df["D_MF"].std() > 1e-3 and (df["M_ctx"].abs() > 1e-4).any()  # the meters are not constant
    # batching does not change anything
    df1, _ = I.measure_prompts(ad, kernel, prompts, batch_size=1)
    pd.testing.assert_frame_equal(df, df1, atol=1e-6, check_exact=False)


def _loss_at_query(model, tokens, target, patch=None):
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)[None])
    with torch.no_grad(), patched_reads(model, patch or (lambda layer, reads: None)):
        logits = model(ids, use_cache=False).logits
    return -torch.log_softmax(logits[0, -1].double(), -1)[int(target)].item(), int(logits[0, -1].argmax())


def test_delta_L_and_permutation_loss_equal_plain_forwards_with_torch_hooks(setup):
    """Acceptance: loss_model, loss_mf (ΔL), loss_perm (ΔL_perm) and accuracy equal plain HF forwards, ẑ written
    by a forward_pre_hook on the output projection at every substituted position (ẑ from the per-position loop)."""
    mt, model, ad, tracked, kernel, ev, doc = setup
    prompts = _prompts(setup, n=3)
    reverse = lambda n, rng: np.arange(n)[::-1]  # noqa: E731
    df, _ = I.measure_prompts(ad, kernel, prompts, batch_size=3, permutation=reverse)
    for _, row in df.groupby("cls").head(1).iterrows():
        p = prompts[int(row["prompt"])]
        zref, sub = slow_zhat(kernel, p.tokens[None])
        assert sub[0, -1]

        def patch(layer, reads):
            new = reads.clone()
            for j in np.flatnonzero(sub[0]):
                new[0, j] = torch.as_tensor(zref[layer, 0, j], dtype=new.dtype)
            return new

        lm, top = _loss_at_query(model, p.tokens, p.target)
        lmf, _ = _loss_at_query(model, p.tokens, p.target, patch)
        perm = p.tokens.copy()
        perm[1:-1] = p.tokens[1:-1][::-1]
        lp, _ = _loss_at_query(model, perm, p.target)
        assert row["loss_model"] == pytest.approx(lm, abs=1e-5)
        assert row["loss_mf"] == pytest.approx(lmf, abs=1e-5)
        assert row["delta_L"] == pytest.approx(lmf - lm, abs=1e-5)
        assert row["delta_L_perm"] == pytest.approx(lp - lm, abs=1e-5)
        assert bool(row["correct"]) == (top == p.target)
    assert (df["delta_L"].abs() > 1e-4).all()  # the substitution is live
    assert (df.loc[df["length"] > 3, "delta_L_perm"].abs() > 1e-6).any()


def test_identity_permutation_changes_nothing_and_zhat_is_order_free(setup):
    """Acceptance: with the identity permutation ΔL_perm = 0 and Δẑ_perm < 1e-6; with a random one ẑ stays
    (float32 round-off) while the model's loss moves."""
    mt, model, ad, tracked, kernel, ev, doc = setup
    prompts = _prompts(setup, n=4)
    ident, _ = I.measure_prompts(ad, kernel, prompts, permutation=lambda n, rng: np.arange(n))
    assert (ident["delta_L_perm"].abs() < 1e-6).all() and (ident["dzhat_perm"] < 1e-6).all()
    rand, _ = I.measure_prompts(ad, kernel, prompts, seed=1)
    assert (rand["dzhat_perm"] < 1e-5).all()
    assert (rand.loc[rand["length"] > 4, "delta_L_perm"].abs() > 1e-6).any()
    # Δẑ_perm measures ẑ: a permutation that is not one (a duplicated token changes the multiset) is caught
    dup = lambda n, rng: np.r_[np.zeros(1, int), np.arange(n - 1)] if n > 1 else np.arange(n)  # noqa: E731
    moved, _ = I.measure_prompts(ad, kernel, [p for p in prompts if len(p) > 4], permutation=dup)
    assert (moved["dzhat_perm"] > 1e-4).any()


def test_prompts_whose_query_has_no_mean_field_are_skipped_and_counted(setup):
    mt, model, ad, tracked, kernel, ev, doc = setup
    prompts = _prompts(setup, n=3)
    untracked = int(np.flatnonzero(kernel.query_lut < 0)[0])
    bad = P.Prompt("natural", np.r_[prompts[0].tokens[:-1], untracked], 3)
    k2 = MeanFieldKernel(kernel.W.clone(), kernel.mu, kernel.key_lut, kernel.query_lut, kernel.n)
    s = int(kernel.query_lut[prompts[1].query])
    k2.W[:, :, s] = float("nan")  # a type never seen as a query
    df, skipped = I.measure_prompts(ad, k2, prompts + [bad], batch_size=8)
    n_bad = 1 + sum(int(kernel.query_lut[p.query]) == s for p in prompts)
    assert sum(skipped.values()) == n_bad and skipped["natural"] >= 1
    assert len(df) == len(prompts) + 1 - n_bad and len(prompts) not in df["prompt"].tolist()
    assert s not in [int(kernel.query_lut[q]) for q in df["query"]]
    assert prompts[1].query not in I.queryable_types(k2) and prompts[1].query in I.queryable_types(kernel)


# ------------------------------------------------------------------ class tables
def test_hedges_g_and_welch_against_a_hand_computed_example():
    from scipy.stats import t as student_t

    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    # s_x² = 5/3, s_y² = 3.5, s_p² = (3 * 5/3 + 5 * 3.5) / 8 = 2.8125, d = -2 / sqrt(2.8125), J = 1 - 3/31
    g = (1 - 3 / 31) * (-2 / np.sqrt(2.8125))
    assert g == pytest.approx(-1.077160, abs=1e-6)
    assert I.hedges_g(x, y) == pytest.approx(g, abs=1e-12)
    # Welch: se² = (5/3)/4 + 3.5/6 = 1, t = -2, df = 1 / ((5/12)²/3 + (7/12)²/5)
    dfw = 1 / ((5 / 12) ** 2 / 3 + (7 / 12) ** 2 / 5)
    p = 2 * student_t.sf(2.0, dfw)
    df = pd.DataFrame({"cls": ["induction"] * 4 + ["random"] * 6, "D_MF": x + y, "M_cov": x + y, "M_ctx": x + y,
                       "delta_L_perm": x + y})
    sep = I.separation_table(df)
    assert len(sep) == 4 and set(sep["class"]) == {"induction"}
    np.testing.assert_allclose(sep["g"], g, atol=1e-12)
    np.testing.assert_allclose(sep["p_welch"], p, rtol=1e-9)
    assert sep["n"].tolist() == [4] * 4 and sep["n_control"].tolist() == [6] * 4
    assert I.hedges_g(y, x) == pytest.approx(-g) and np.isnan(I.hedges_g([1.0], y))
    md = I.separation_markdown(sep)
    assert "-1.08" in md and "induction (n=4)" in md


def test_class_table_means_max_and_accuracy():
    df = pd.DataFrame({"cls": ["random", "induction", "induction", "random"], "D_MF": [0.1, 0.5, 0.7, 0.3],
                       "M_cov": [0.05, 0.2, 0.4, 0.1], "M_ctx": [0.05, 0.3, 0.3, 0.2], "delta_L": [0.0, 2.0, 4.0, 1.0],
                       "delta_L_perm": [0.1, 3.0, 5.0, -0.1], "dzhat_perm": [1e-7, 3e-7, 2e-7, 0.0],
                       "correct": [False, True, True, True], "loss_model": [5.0, 1.0, 2.0, 6.0]})
    df.attrs["skipped"] = {"random": 2}
    t = I.class_table(df)
    assert t["class"].tolist() == ["induction", "random"]  # paper order
    ind, rnd = t.iloc[0], t.iloc[1]
    assert ind["n"] == 2 and ind["D_MF"] == pytest.approx(0.6) and ind["delta_L_perm"] == pytest.approx(4.0)
    assert ind["dzhat_perm_max"] == pytest.approx(3e-7) and ind["accuracy"] == 1.0
    assert rnd["accuracy"] == 0.5 and rnd["skipped"] == 2 and rnd["M_ctx"] == pytest.approx(0.125)


# ------------------------------------------------------------------ Experiment 1
def test_meter_sequences_repeat_a_one_document_chunk():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(10, 21))
    tokens[:, 0] = 99
    doc = np.repeat(np.arange(10)[:, None], 21, axis=1)
    doc[:4, 5:] += 100  # four windows whose chunk spans a document boundary
    seqs, spanning = P.meter_sequences(tokens, doc, 8, bos_id=99, seed=0)
    assert seqs.shape == (8, 21) and spanning == 2 and (seqs[:, 0] == 99).all()
    np.testing.assert_array_equal(seqs[:, 1:11], seqs[:, 11:])
    chunks = {tuple(r) for r in tokens[4:, 1:11]}
    assert sum(tuple(s[1:11]) in chunks for s in seqs) == 6  # the one-document chunks come first
    with pytest.raises(ValueError, match="chunk length"):
        P.meter_sequences(tokens, doc, 2, k=11, bos_id=99)


def test_instance_meter_equals_per_prefix_measurements(setup):
    """The vectorized meter: per position the loss and D_MF of every prefix [BOS; c; c][:p+1] as its own prompt
    (measure_prompts), averaged over the sequences where the position is valid; the matched pairs, their Spearman
    correlation and equal-count bins from the same numbers; the top head's rise consistent with the head table."""
    from scipy.stats import spearmanr

    mt, model, ad, tracked, kernel, ev, doc = setup
    seqs, _ = P.meter_sequences(ev, doc, 3, bos_id=tracked.bos_id, seed=0)
    n, T = seqs.shape
    kk = (T - 1) // 2
    r = IM.instance_meter(ad, kernel, seqs, batch_size=2)
    tabs = IM.meter_tables(r, n_bins=3)
    prompts = [P.Prompt("natural", s[: p + 1], s[p + 1], meta={"b": b, "p": p})
               for b, s in enumerate(seqs) for p in range(1, T - 1)]
    df, _ = I.measure_prompts(ad, kernel, prompts, batch_size=8, permutation=lambda m, rng: np.arange(m))
    D = np.full((n, T), np.nan)
    loss = np.full((n, T), np.nan)
    for _, row in df.iterrows():
        m = prompts[int(row["prompt"])].meta
        D[m["b"], m["p"]], loss[m["b"], m["p"]] = row["D_MF"], row["loss_model"]
    cur = tabs["curves"]
    # (the last position has no next token: not a prompt)
    assert (cur["n_valid"].to_numpy()[: T - 1] == np.isfinite(D).sum(0)[: T - 1]).all()
    assert cur["n_valid"].sum() > n * kk
    cnt = np.maximum(np.isfinite(D).sum(0), 1)
    want_D, want_loss = np.nansum(D, 0) / cnt, np.nansum(loss, 0) / cnt
    np.testing.assert_allclose(cur["D_MF"][1 : T - 1], want_D[1 : T - 1], atol=1e-5)
    np.testing.assert_allclose(cur["loss"][1 : T - 1], want_loss[1 : T - 1], atol=1e-5)
    i = np.arange(1, kk)
    ok = np.isfinite(D[:, i]) & np.isfinite(D[:, i + kk])
    red, rise = (loss[:, i] - loss[:, i + kk])[ok], (D[:, i + kk] - D[:, i])[ok]
    s = tabs["summary"].iloc[0]
    assert s["n_pairs"] == ok.sum() > 5 and s["n_sequences"] == n and s["k"] == kk
    assert s["spearman_rho"] == pytest.approx(spearmanr(rise, red)[0], abs=1e-6)
    bins = tabs["bins"]
    assert bins["n"].sum() == ok.sum() and bins["n"].max() - bins["n"].min() <= 1
    order = np.argsort(rise, kind="stable")
    first = order[: bins["n"].iloc[0]]
    assert bins["loss_reduction_mean"].iloc[0] == pytest.approx(red[first].mean(), abs=1e-6)
    assert bins["loss_reduction_sem"].iloc[0] == pytest.approx(red[first].std(ddof=1) / np.sqrt(len(first)), abs=1e-6)
    assert (np.diff(bins["rise_mean"]) > 0).all()
    heads = tabs["heads"]
    top = heads.loc[heads["rise"].idxmax()]
    assert (int(top["layer"]), int(top["head"])) == (s["top_layer"], s["top_head"])
    assert s["top_head_rise"] == pytest.approx(top["D_copy2"] - top["D_copy1"])
    # the head means average to D_MF over each copy (same valid positions)
    assert heads["D_copy1"].mean() == pytest.approx(s["D_MF_copy1"], abs=1e-9)
    assert heads["D_copy2"].mean() == pytest.approx(s["D_MF_copy2"], abs=1e-9)


# ------------------------------------------------------------------ end to end with a real tokenizer
def test_prompt_classes_tables_and_figures_end_to_end(tokenizer, tmp_path, monkeypatch):
    """The job's path on a tiny GPT-2 with the trained tokenizer: all four classes generated and measured, the
    tables and both figures written."""
    from mfpipe.workflow.tables import write_table

    tok, texts = tokenizer
    model = make_tiny_model("gpt2", seed=3, vocab_size=len(tok), bos_token_id=0, eos_token_id=0)
    ad = get_adapter(model)
    stream = [i for t in texts * 3 for i in tok(t + "\n", add_special_tokens=False)["input_ids"]]
    T = 48
    n_win = len(stream) // (T - 1)
    windows = np.concatenate([np.zeros((n_win, 1), np.int64), np.asarray(stream[: n_win * (T - 1)]).reshape(n_win, -1)],
                             axis=1)
    tracked = tracked_for(windows, n=60, bos=0, vocab=len(tok))
    colon = tok(":", add_special_tokens=False)["input_ids"][0]
    assert colon in tracked.type_ids.tolist()
    tracked.strings = [tok.decode([int(i)]) for i in tracked.type_ids]
    st = _store(model, ad, windows[: n_win // 2], tracked, tmp_path / "stats.zarr")
    kernel = kernel_from_store(st, tracked, min_count=1)
    ev = windows[n_win // 2 :]
    doc = np.repeat(np.arange(len(ev))[:, None], T, axis=1)
    prompts, info = P.prompt_classes(I.queryable_types(kernel), tok, tracked, T, ev, doc, n=6, n_fewshot=6,
                                     n_random=8, seed=0, tasks=("copying", "successor"))
    assert info["counts"] == {"induction": 6, "few-shot": 6, "natural": 6, "random": 6}
    assert set(info["tasks"]) == {"copying", "successor"}
    df, skipped = I.measure_prompts(ad, kernel, prompts, batch_size=4)
    df.attrs["skipped"] = skipped
    assert set(df["cls"]) == set(P.CLASSES) and (df.loc[df["cls"] == "few-shot", "query"] == colon).all()
    table = I.class_table(df)
    sep = I.separation_table(df)
    assert table["class"].tolist() == list(P.CLASSES) and len(sep) == 4 * 3
    write_table(table, csv=tmp_path / "icl.csv")
    write_table(df, csv=tmp_path / "prompts.csv")
    (tmp_path / "icl.md").write_text(I.class_markdown(table))
    # the figures are drawn by their own rules from the CSVs the forward jobs wrote (no model in the figure job)
    figures = capture(monkeypatch)
    pdf, png = PF.icl_figure(tmp_path / "prompts.csv", tmp_path / "icl")
    (ax,) = main_axes(figures[-1])
    clouds = scatter(ax)
    assert len(clouds) == len(P.CLASSES)
    for c, g in df.groupby("cls"):  # each class's prompts at (D_MF, ΔL_perm), as the table holds them
        np.testing.assert_allclose(clouds[f"{c} (n={len(g)})"], g[["D_MF", "delta_L_perm"]].to_numpy(), rtol=1e-6)
    seqs, _ = P.meter_sequences(ev, doc, 2, bos_id=0)
    tabs = IM.meter_tables(IM.instance_meter(ad, kernel, seqs), n_bins=4)
    for key in ("curves", "bins", "summary"):
        write_table(tabs[key], csv=tmp_path / f"meter_{key}.csv")
    pdf2, png2 = PF.meter_figure(*(tmp_path / f"meter_{key}.csv" for key in ("curves", "bins", "summary")),
                                 tmp_path / "meter")
    loss_ax, head_ax, bins_ax, dmf_ax = main_axes(figures[-1])  # the twin axis (D_MF) is made last
    c = tabs["curves"][tabs["curves"]["position"] > 0]
    for ax, key, col in ((loss_ax, "next-token loss", "loss"), (dmf_ax, r"$D_{\mathrm{MF}}$", "D_MF")):
        np.testing.assert_array_equal(lines(ax)[key][0], c["position"])
        np.testing.assert_allclose(lines(ax)[key][1], c[col], rtol=1e-6)
    (x, y), = lines(head_ax).values()
    np.testing.assert_allclose(y, c["top_head_D"], rtol=1e-6)
    data_line = bins_ax.containers[0].lines[0]  # the error bars' own line (not their caps)
    x, y = np.asarray(data_line.get_xdata(), float), np.asarray(data_line.get_ydata(), float)
    np.testing.assert_allclose(x, tabs["bins"]["rise_mean"], rtol=1e-6)
    np.testing.assert_allclose(y, tabs["bins"]["loss_reduction_mean"], rtol=1e-6)
    for f in (pdf, png, pdf2, png2, tmp_path / "icl.md"):
        assert f.stat().st_size > 0
    md = (tmp_path / "icl.md").read_text()
    assert re.search(r"\| induction \| 6 \|", md) and re.search(r"\| \d\.\de-0\d \|", md)
