"""Function vectors from mean-field deviation (issue 29; paper Sec. 6.4, eq:taskresid, App. fv): the task deviation
r against a slow per-prompt loop, AIE against per-head patching written with plain torch hooks, the two injection
protocols against torch hooks, a zero vector leaving the logits bit-identical, and the experiment end to end."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hf_reference import blocks, o_proj, patched_reads, shape
from stats_reference import tracked_for
from tiny_models import make_tiny_model, tiny_jamba

from mfpipe.experiments.fv import experiment as E
from mfpipe.experiments.fv import heads as Hd
from mfpipe.experiments.fv import inject as Inj
from mfpipe.experiments.fv import prompts as Pr
from mfpipe.experiments.fv import tables as Tb
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store
from mfpipe.tasks import FewShotTask

T_CTX = 48
WORDS = ("hot cold big small red blue green cat dog sun moon tree house water fire light dark fast slow good bad "
         "the and you she one two three four five six seven eight nine ten").split()


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from mfpipe.minisuite.tokenizer import train_tokenizer

    texts = []
    for i in range(40):
        j = (i * 3) % len(WORDS)
        texts.append(" ".join(WORDS[j:] + WORDS[:j]) + ".")
        texts.append("\n".join(f"{w}: {WORDS[(k + i) % len(WORDS)]}" for k, w in enumerate(WORDS[i % 7 :: 3])))
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 400, 2, out)
    return AutoTokenizer.from_pretrained(str(out)), texts


def _task(name="shift", k=3):
    return FewShotTask(name, [(w, WORDS[(i + k) % len(WORDS)]) for i, w in enumerate(WORDS)])


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def setup(request, tok, tmp_path_factory):
    tk, texts = tok
    model = make_tiny_model(request.param, seed=3, vocab_size=len(tk), bos_token_id=0, eos_token_id=0)
    ad = get_adapter(model)
    tracked, st = _stats_store(model, ad, tk, texts * 3, tmp_path_factory.mktemp("fv") / "stats.zarr")
    return model, ad, tk, tracked, st


def _stats_store(model, ad, tk, texts, path):
    """(the tracked set, the opened statistics store) of ``model`` on ``texts`` packed into BOS-led windows."""
    stream = [i for t in texts for i in tk(t + "\n", add_special_tokens=False)["input_ids"]]
    n_win = len(stream) // (T_CTX - 1)
    windows = np.concatenate([np.zeros((n_win, 1), np.int64),
                              np.asarray(stream[: n_win * (T_CTX - 1)]).reshape(n_win, -1)], axis=1)
    tracked = tracked_for(windows, n=60, bos=0, vocab=len(tk))
    sums = accumulate_shard(model, ad, windows, tracked, batch_size=8, device="cpu", progress=False)
    meta = {"model": "tiny", "revision": "r1", "half": "stats", "corpus": "t", "corpus_fingerprint": "fp",
            "model_type": ad.model_type}
    return tracked, open_stats(write_store(finalize(sums, tracked, meta), path))


CFG = dict(n_pairs=20, n_extract=8, n_splits=2, n_shots=3, n_clean=6, n_corrupted=3, n_selected=3,
           sum_scales=[1.0, 4.0], head_scales=[1.0, 3.0], answer_prefix=" ", batch_size=16, seed=1)


DEFAULT_FV = {k: v for k, v in E.DEFAULTS.items() if k not in ("null", "head_lists")}


def _pool(tk, n=20):
    return Pr.task_pool(_task(), tk, 0, n_pairs=n, seed=1, answer_prefix=" ")


# ------------------------------------------------------------------ prompts
def test_prompts_split_and_encode_as_documented(tok):
    tk, _ = tok
    pool = _pool(tk)
    assert len(pool.pairs) == 20 and len(pool.answers) == 20
    sp = Pr.splits(20, 8, 3, seed=0)
    assert len(sp) == 3 and all(len(e) == 8 and len(h) == 12 and not set(e) & set(h) for e, h in sp)
    assert not np.array_equal(sp[0][0], sp[1][0])
    ext = sp[0][0]
    clean = Pr.clean_prompts(pool, tk, 0, ext, n_shots=3, n_prompts=5, seed=0)
    for p in clean:
        x, y = pool.pairs[p.pair]
        assert p.tokens[0] == 0 and p.text.endswith(f"\n{x}:") and p.text.count("\n") == 3
        assert tk.decode([p.answer]).strip() == tk.decode(tk(" " + y, add_special_tokens=False)["input_ids"][:1]).strip()
    bad = Pr.corrupted_prompts(pool, tk, 0, ext, n_shots=3, n_prompts=4, seed=0)
    for p in bad:  # the exemplars' answers are shuffled: no exemplar keeps its own answer
        lines = p.text.split("\n")[:-1]
        truth = dict(pool.pairs)
        assert all(truth[x] != y.strip() for x, y in (ln.split(":") for ln in lines))
    zs = Pr.zeroshot_prompts(pool, [0, 1])
    assert all(len(p.tokens) >= 3 and p.tokens[0] == 0 for p in zs)
    with pytest.raises(ValueError, match="n_pairs"):
        Pr.task_pool(_task(), tk, 0, n_pairs=500)


# ------------------------------------------------------------------ r = E[z] - zhat (eq:taskresid)
def test_task_deviation_equals_a_slow_per_prompt_loop(setup):
    model, ad, tk, tracked, st = setup
    pool = _pool(tk)
    prompts = Pr.clean_prompts(pool, tk, 0, np.arange(8), n_shots=3, n_prompts=6, seed=0)
    cue = int(prompts[0].tokens[-1])
    got = Hd.task_deviation(Hd.cue_reads(ad, prompts, batch_size=4).mean, Hd.corpus_null(st, tracked, cue))
    # reference: one prompt at a time through a plain forward_pre_hook on the output projection, the null by hand
    H, _, dh = shape(model)
    L = len(blocks(model))
    acc = np.zeros((L, H, dh))
    for p in prompts:
        seen = {}
        hs = [o_proj(model, l).register_forward_pre_hook(
            lambda m, a, l=l: seen.__setitem__(l, a[0][0, -1].detach().double().reshape(H, dh).numpy()))
            for l in range(L)]
        with torch.no_grad():
            model(torch.as_tensor(p.tokens)[None])
        for h in hs:
            h.remove()
        acc += np.stack([seen[l] for l in range(L)])
    mean = acc / len(prompts)
    q = int(tracked.query_bucket_lut()[cue])
    P = np.asarray(st.P().transpose("layer", "head", "query", "key").values, np.float64)
    mu = np.asarray(st.mu().transpose("layer", "head", "key", "head_dim").values, np.float64)
    null = np.zeros((L, H, dh))
    for l in range(L):
        for h in range(H):
            for k in range(P.shape[-1]):
                null[l, h] += P[l, h, q, k] * mu[l, h, k]
    np.testing.assert_allclose(got.double().numpy(), mean - null, atol=2e-5, rtol=1e-4)


def test_an_untracked_cue_is_refused_with_a_clear_error(setup):
    _, _, _, tracked, st = setup
    untracked = next(i for i in range(tracked.vocab_size) if tracked.query_bucket_lut()[i] < 0
                     and i != tracked.bos_id)
    with pytest.raises(ValueError, match="not a tracked query type"):
        Hd.corpus_null(st, tracked, untracked)


# ------------------------------------------------------------------ AIE against plain torch hooks
AIE_ATOL = 2e-8  # on answer probabilities; the measured gap is 1.7e-10 (gpt2) and 1.2e-10 (gemma2)
INJECTION_ATOL = 5e-8  # the measured gap is 2.1e-9 at most (gemma2's per-head protocol)


def test_aie_equals_per_head_patching_with_torch_hooks(setup):
    model, ad, tk, _, _ = setup
    pool = _pool(tk)
    ext = np.arange(8)
    clean = Pr.clean_prompts(pool, tk, 0, ext, n_shots=3, n_prompts=6, seed=0)
    bad = Pr.corrupted_prompts(pool, tk, 0, ext, n_shots=3, n_prompts=3, seed=0)
    mean = Hd.cue_reads(ad, clean).mean
    got, p0, _ = Hd.aie(ad, bad, mean, batch_size=5)
    H, _, dh = shape(model)
    L = len(blocks(model))
    ref = np.zeros((L, H))
    base = []
    for p in bad:
        ids = torch.as_tensor(p.tokens)[None]
        with torch.no_grad():
            p_clean = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
        base.append(p_clean)
        for l in range(L):
            for h in range(H):
                def patch(layer, reads, l=l, h=h):
                    if layer != l:
                        return None
                    out = reads.clone()
                    out[0, -1, h] = mean[l, h]
                    return out
                with patched_reads(model, patch), torch.no_grad():
                    pp = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
                ref[l, h] += (pp - p_clean) / len(bad)
    # float32 forwards, batched against one at a time: measured at most 1.7e-10 apart on answer probabilities ~1e-3
    np.testing.assert_allclose(got.numpy(), ref, atol=AIE_ATOL)
    # the effects compared are far above that tolerance: a patch that changed nothing (or a reference that patched
    # nothing) would be caught, not passed within it; the median, so most heads, not one, carry a measurable effect
    assert np.median(np.abs(ref)) >= 100 * AIE_ATOL, np.abs(ref)
    assert p0 == pytest.approx(np.mean(base), abs=AIE_ATOL) and np.mean(base) >= 100 * AIE_ATOL


# ------------------------------------------------------------------ injections
def test_a_zero_vector_leaves_the_logits_bit_identical(setup):
    _, ad, tk, _, _ = setup
    ids = torch.as_tensor(np.stack([p.tokens for p in Pr.zeroshot_prompts(_pool(tk), [0])] * 2))
    base = ad.run(ids, select=(), logits=True).logits
    zero = torch.zeros(ad.d_model)

    def add(layer, resid):
        out = resid.clone()
        out[:, -1] += zero
        return out

    def add_reads(layer, reads):
        out = reads.clone()
        out[:, -1] += 0.0
        return out

    assert torch.equal(ad.run(ids, select=(), logits=True, patch_resid=add).logits, base)
    assert torch.equal(ad.run(ids, select=(), logits=True, patch_reads=add_reads).logits, base)
    O = Hd.out_slices(ad)
    zs = Pr.zeroshot_prompts(_pool(tk), range(6))
    z = torch.zeros(ad.n_layers, ad.n_heads, ad.d_head)
    t1, pa = Inj.evaluate(ad, zs, [Inj.Injection(), Inj.sum_injection(z, [(0, 0), (1, 1)], O, 1, 5.0),
                                   Inj.per_head_injection(z, [(0, 0), (1, 1)], 5.0)])
    assert (t1 == t1[0]).all() and (pa == pa[0]).all()


def test_injections_equal_torch_hook_references(setup):
    model, ad, tk, _, _ = setup
    zs = Pr.zeroshot_prompts(_pool(tk), range(6))
    O = Hd.out_slices(ad)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(ad.n_layers, ad.n_heads, ad.d_head, generator=g)
    heads = [(0, 1), (1, 0), (1, 2)]
    injs = [Inj.sum_injection(v, heads, O, 1, 3.0), Inj.per_head_injection(v, heads, 2.0)]
    _, pa = Inj.evaluate(ad, zs, injs, batch_size=4)
    fv = 3.0 * sum(v[l, h].double().numpy() @ np.asarray(O[l, h], np.float64) for l, h in heads)
    for j, p in enumerate(zs):
        ids = torch.as_tensor(p.tokens)[None]

        def pre(mod, args, kwargs):
            key = "hidden_states" if not args else None
            x = (kwargs[key] if key else args[0]).clone()
            x[:, -1] += torch.as_tensor(fv, dtype=x.dtype)
            if key:
                kwargs[key] = x
                return args, kwargs
            return (x, *args[1:]), kwargs

        with torch.no_grad():
            plain = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
        hd = blocks(model)[1].register_forward_pre_hook(pre, with_kwargs=True)
        with torch.no_grad():
            ref = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
        hd.remove()
        assert pa[0, j] == pytest.approx(ref, abs=INJECTION_ATOL)
        # the injection's effect on every prompt is far above the tolerance (an injection dropped would fail)
        assert abs(ref - plain) >= 100 * INJECTION_ATOL, (j, ref, plain)

        def patch(layer, reads):
            out = reads.clone()
            for l, h in heads:
                if l == layer:
                    out[0, -1, h] += 2.0 * v[l, h]
            return out

        with patched_reads(model, patch), torch.no_grad():
            ref = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
        assert pa[1, j] == pytest.approx(ref, abs=INJECTION_ATOL)
        assert abs(ref - plain) >= 100 * INJECTION_ATOL, (j, ref, plain)


# ------------------------------------------------------------------ the experiment and its tables
GIVEN = ["L1H2", "L0H1", "L1H0"]


@pytest.fixture(scope="module")
def ran(setup):
    model, ad, tk, tracked, st = setup
    cfg = dict(CFG, head_lists={"given": {"*": GIVEN}}, clean_sweep=[1, 2, 6])
    return E.run_task(ad, _task(), tk, 0, lambda cue: Hd.corpus_null(st, tracked, cue), cfg, context_length=T_CTX)


def test_run_task_tables_and_figure(setup, ran, tmp_path, monkeypatch):
    model, ad, tk, tracked, st = setup
    out = ran
    tr = out["transfer"]
    assert set(tr["protocol"]) == {"zero-shot", "few-shot", "sum", "per_head"}
    assert set(tr.loc[tr["protocol"] == "sum", "selection"]) == set(E.SELECTIONS) | {"given"}
    assert (tr["n"] == 12).all() and (tr["correct"] <= tr["n"]).all() and (tr["in_category"] >= tr["correct"]).all()
    sw = out["sweep"]
    tune = sw[sw["pairs"] == "extraction"]
    # each split: one (layer, scale) for the four pipelines, from its own extraction pairs
    assert (tune[tune["protocol"] == "sum"].groupby("split")["chosen"].sum() == 4).all()
    assert (tune["n"] == 8).all() and set(tune["split"]) == {0, 1}
    h = out["heads"]
    assert len(h) == 2 * ad.n_layers * ad.n_heads and h.groupby("split")["sel_MFA"].sum().eq(3).all()
    assert (h.groupby("split")["sel_AIE"].sum() == 3).all()
    given = {(int(x[1]), int(x[3])) for x in GIVEN}
    assert set(zip(h.loc[h["sel_given"], "layer"], h.loc[h["sel_given"], "head"])) == given
    rk = out["ranks"]
    heads_rk = rk[rk["vector"] == "head r"]
    assert {"raw"} <= set(rk["lens"]) and rk["median_rank_seen"].notna().all()
    assert len(heads_rk) == ad.n_layers * ad.n_heads and sorted(heads_rk["head_order"]) == list(range(len(heads_rk)))
    assert {"sum given r", "sum AIE raw"} <= set(rk["vector"])
    pr = out["prompt_ranks"]
    assert len(pr) == ad.n_layers * ad.n_heads and pr["selections"].str.contains("given").sum() == 3
    results = {k: out[k] for k in E.PARTS}
    tabs = Tb.fv_tables(results, [out["info"]])
    assert {"matrix_sum", "matrix_per_head", "stability", "category", "clean", "recovery", "tally"} <= set(tabs)
    m = tabs["transfer"]
    row = m[(m["protocol"] == "sum") & (m["selection"] == "MFA") & (m["construction"] == "r")].iloc[0]
    assert row["n"] == 24 and row["ci_lo"] <= row["accuracy"] <= row["ci_hi"]
    md = Tb.matrix_markdown(tabs["transfer"], tabs["stability"], "sum", "tiny", "r1", null=["type_mean"])
    assert "AIE∩MFA" in md and "given∩MFA" in md and "given r" in md and "shift" in md and "measured mean" in md
    from mfpipe.experiments.fv import details as Dt
    from mfpipe.experiments.fv import figures as Fg

    det = Dt.details_markdown(tabs, "tiny", "r1")
    assert "recovered by the pipeline's own AIE" in det and "Wilcoxon" in det and "at every setting" in det
    assert "n_clean" in Dt.clean_markdown(tabs["clean"], "tiny", "r1")
    from figure_data import bars, capture, main_axes

    figures = capture(monkeypatch)
    Fg.plot_transfer(tabs["transfer"], tmp_path / "fv.png", title="tiny")
    Fg.plot_clean_sweep(tabs["clean"], tmp_path / "clean.png", title="tiny")
    assert (tmp_path / "fv.png").stat().st_size > 1000 and (tmp_path / "clean.png").stat().st_size > 1000
    # what is drawn: a bar per task for each selection x construction, its height the summed protocol's accuracy
    (ax,) = main_axes(figures[0])
    drawn = bars(ax)
    tasks = list(dict.fromkeys(m["task"]))
    for sel, cons in Fg.PIPES:
        want = [m[(m["task"] == t) & (m["protocol"] == "sum") & (m["selection"] == sel)
                  & (m["construction"] == cons)]["accuracy"].iloc[0] for t in tasks]
        np.testing.assert_allclose(drawn[f"{sel} · {cons}"][1], want, rtol=1e-12)
    # the clean sweep: per task and protocol, MFA·r's accuracy against the number of clean prompts
    cl = tabs["clean"]
    for ax, task in zip(main_axes(figures[1]), list(dict.fromkeys(cl["task"]))):
        for container in ax.containers:
            prot = container.get_label().split("(")[1].rstrip(")")
            g = cl[(cl["task"] == task) & (cl["protocol"] == prot)].sort_values("n_clean")
            line = container.lines[0]
            np.testing.assert_array_equal(np.asarray(line.get_xdata(), float), g["n_clean"])
            np.testing.assert_allclose(np.asarray(line.get_ydata(), float), g["accuracy"], rtol=1e-12)
        assert len(ax.containers) == cl.loc[cl["task"] == task, "protocol"].nunique() > 0


def test_the_sweeps_agree_with_the_main_table_at_its_own_cells(ran):
    """Item 5 and 6: the raw-magnitude control's sweep at the split's chosen setting is the main table's
    raw-magnitude cell, and the clean-prompt sweep at every clean prompt is the main table's MFA·r cell (the same
    injections scored in other batches: fails if either sweep builds its vectors, selection or setting otherwise)."""
    tr, sw, cl = ran["transfer"], ran["sweep"], ran["clean"]
    main = tr.set_index(["split", "protocol", "selection", "construction"])["correct"]
    raw = sw[(sw["pairs"] == "held-out") & sw["chosen"]]
    assert len(raw) == 2 * 2 * 2  # splits x protocols x constructions
    for r in raw.itertuples():
        assert r.correct == main[(r.split, r.protocol, "raw-magnitude", r.construction)]
    n_grid = (2 * len(CFG["sum_scales"]) + len(CFG["head_scales"])) * 2 * 2  # (L x sum + head scales) x cons x splits
    assert len(sw[sw["pairs"] == "held-out"]) == n_grid
    assert sorted(set(cl["n_clean"])) == [1, 2, 6]
    for r in cl[cl["n_clean"] == 6].itertuples():
        assert r.correct == main[(r.split, r.protocol, "MFA", "r")]
    one = cl[cl["n_clean"] == 1]
    assert len(one) == 4 and one["heads"].str.count("L").eq(3).all()


def test_no_split_tunes_or_selects_on_its_own_held_out_pairs(ran, setup):
    """Item 3: every pair a split's sweep, AIE prompts (queries and exemplars) and clean prompts use is one of its
    extraction pairs; none is among its held-out pairs (each split tunes on its own extraction pairs)."""
    info = ran["info"]
    sp = Pr.splits(CFG["n_pairs"], CFG["n_extract"], CFG["n_splits"], CFG["seed"])
    assert len(info["tuning_pairs"]) == len(sp) == 2
    for (ext, held), tuning, held_rec in zip(sp, info["tuning_pairs"], info["held_out_pairs"]):
        assert held_rec == held.tolist()
        assert set(tuning) == set(ext.tolist())  # the sweep scores every extraction pair
        assert not set(tuning) & set(held.tolist())
    # and the prompts themselves: the label-shuffled prompts of split 1 draw only its extraction pairs
    model, ad, tk, tracked, st = setup
    pool = _pool(tk)
    bad = Pr.corrupted_prompts(pool, tk, 0, sp[1][0], n_shots=3, n_prompts=3, seed=[CFG["seed"], 1])
    assert bad and all({p.pair, *p.exemplars} <= set(sp[1][0].tolist()) for p in bad)


def test_the_decode_populations_are_the_papers(ran, setup):
    """Item 4: seen answers from the extraction prompts, held-out answers not among them, out-of-task answers in none
    of the drawn pairs, unrelated words from the shipped list and not of the task's category; counts as configured."""
    from mfpipe.experiments.fv import decode as Dc

    model, ad, tk, tracked, st = setup
    pool = _pool(tk)
    sp = Pr.splits(20, 8, 2, 1)
    d0 = {"ext": sp[0][0], "held": sp[0][1]}
    pops = Dc.populations(tk, pool, d0, 0, {"seen": 4, "held_out": 3, "out_of_task": 2, "unrelated": 5}, 1, " ")
    assert [len(pops[k]) for k in ("seen", "held-out", "unrelated")] == [4, 3, 5]
    assert set(pops["seen"]) <= set(pool.answers[d0["ext"]].tolist())
    assert set(pops["held-out"]) <= set(pool.answers[d0["held"]].tolist())
    assert not set(pops["held-out"]) & set(pool.answers[d0["ext"]].tolist())
    assert not set(pops["out-of-task"]) & set(pool.answers.tolist()) and len(pops["out-of-task"]) <= 2
    assert not set(pops["unrelated"]) & set(pool.category.tolist())
    from mfpipe.tasks import unrelated_words

    firsts = {tk(" " + w, add_special_tokens=False)["input_ids"][0] for w in unrelated_words()}
    assert set(pops["unrelated"]) <= firsts
    # the defaults are the paper's 10 / 10 / 15 / 15
    assert {k: v for k, (_, v) in Dc.POPULATIONS.items()} == {"seen": 10, "held-out": 10, "out-of-task": 15,
                                                                "unrelated": 15}


def test_pairs_answered_by_the_querys_first_token_are_dropped(tok):
    """Item 8: a pair whose answer token is the query's first token (a copy) is dropped, and counted."""
    tk, _ = tok
    pairs = [(w, WORDS[(i + 3) % len(WORDS)]) for i, w in enumerate(WORDS)]
    copies = [(w, w) for w in WORDS[:5]]
    pool = Pr.task_pool(FewShotTask("mix", pairs + copies), tk, 0, n_pairs=20, seed=0, answer_prefix="")
    assert pool.meta["copy"] == 5 and pool.dropped == pool.meta["copy"] + pool.meta["undefined"]
    assert not any(x == y for x, y in pool.pairs)
    first = [int(p.tokens[1]) for p in pool.zeroshot]
    assert all(a != f for a, f in zip(pool.answers, first))


def test_bold_marks_every_pipeline_within_the_tie_margin():
    """Item 8: bold within 0.02 of the best AIE / MFA / head-list pipeline, as the paper's tables."""
    acc = {("AIE", "raw"): 50, ("AIE", "r"): 49, ("MFA", "raw"): 47, ("MFA", "r"): 10, ("todd", "r"): 48,
           ("todd", "raw"): 20, ("raw-magnitude", "raw"): 90, ("random", "r"): 0}
    rows = [dict(task="t", split=0, protocol="sum", selection=s, construction=c, n=100, correct=k, in_category=k,
                 seen_answer=0, p_answer=0.1, layer=1, scale=2.0) for (s, c), k in acc.items()]
    t = Tb.transfer_table(pd.DataFrame(rows))
    st = pd.DataFrame([dict(task="t", n_selected=4, aie_mfa_overlap="1", todd_mfa_overlap="2")])
    md = Tb.matrix_markdown(t, st, "sum", "m", "r")
    row = next(ln for ln in md.splitlines() if ln.startswith("| t |"))
    cells = dict(zip(next(ln for ln in md.splitlines() if ln.startswith("| task")).split(" | "), row.split(" | ")))
    bold = {k for k, v in cells.items() if v.startswith("**")}
    assert bold == {"AIE raw", "AIE r", "todd r"}, cells  # 0.50, 0.49, 0.48 (0.47 is outside; the control never)
    assert cells["todd∩MFA"] == "2/4"


def test_seed_spread_and_conclusions_count_each_seed():
    """Two seeds of one task: the tables are the first seed's, each accuracy carries the mean and range over both,
    and the comparisons are counted per seed."""
    def rows(seed, acc):  # acc: {(selection, construction): correct of 10}
        out = [dict(task="t", split=0, protocol="sum", selection=s, construction=c, n=10, correct=k, in_category=k,
                    seen_answer=0, p_answer=0.1, layer=1, scale=2.0, seed=seed) for (s, c), k in acc.items()]
        return pd.DataFrame(out)

    a = {("AIE", "raw"): 5, ("AIE", "r"): 3, ("MFA", "raw"): 4, ("MFA", "r"): 6, ("raw-magnitude", "raw"): 2,
         ("raw-magnitude", "r"): 7, ("random", "r"): 1}
    b = {("AIE", "raw"): 7, ("AIE", "r"): 3, ("MFA", "raw"): 4, ("MFA", "r"): 2, ("raw-magnitude", "raw"): 4,
         ("raw-magnitude", "r"): 1, ("random", "r"): 3}
    tr = pd.concat([rows(0, a), rows(1, b)], ignore_index=True)
    sp = Tb.seed_spread(tr).set_index(["selection", "construction"])
    assert sp.loc[("MFA", "r"), "seed_mean"] == pytest.approx(0.4)
    assert (sp.loc[("MFA", "r"), "seed_min"], sp.loc[("MFA", "r"), "seed_max"]) == (0.2, 0.6)
    assert (sp["n_seeds"] == 2).all()
    c = Tb.conclusions_table(tr).iloc[0]
    assert c["best_by_seed"] == "MFA·r, AIE·raw" and c["most_often_best"] == "MFA·r (1/2)"
    assert c["raw_magnitude_below_MFA_r"] == "1/2" and c["MFA_r_above_random"] == "1/2"
    assert c["raw_magnitude_r_below_MFA_r"] == "1/2"


def test_wilson_interval_matches_the_formula():
    lo, hi = Tb.wilson(60, 120)
    z = 1.959963984540054
    p, n = 0.5, 120
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    w = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert lo == pytest.approx(c - w) and hi == pytest.approx(c + w)
    assert Tb.wilson(0, 40)[0] == 0.0 and Tb.wilson(40, 40)[1] == pytest.approx(1.0)


def test_the_presets_run_the_papers_six_tasks_on_the_papers_models():
    """Every preset carries the same block (a run of several presets shares it): the six tasks of Sec. 6.4 on GPT-2
    small, Gemma-2-2B and GPT-J-6B; the mini default runs the tasks its models learned."""
    from pathlib import Path

    import yaml

    from mfpipe.tasks import PAPER_FV_TASKS, vendored_tasks

    repo = Path(__file__).resolve().parents[1]
    base = yaml.safe_load((repo / "config" / "config.yaml").read_text())["fv"]
    assert base["tasks"] == ["minisuite"]
    blocks = [yaml.safe_load(p.read_text())["fv"] for p in sorted((repo / "config" / "presets").glob("*.yaml"))]
    assert len(blocks) == 13 and all(b == blocks[0] for b in blocks)
    assert tuple(blocks[0]["tasks"]) == PAPER_FV_TASKS and set(PAPER_FV_TASKS) <= set(vendored_tasks())
    assert blocks[0]["models"] == ["gpt2-small", "gemma-2-2b", "gpt-j-6b"]


def test_the_task_files_a_job_reads_are_its_inputs_relative_to_the_working_directory(monkeypatch):
    """The vendored datasets a preset names and the unrelated-word list the decode populations draw from are inputs
    of the function-vector job, and the ICL datasets of the prompt-class job, as paths relative to the working
    directory: an absolute one would make a project moved elsewhere rerun them (Snakemake compares the recorded set
    of inputs), as the code inputs'."""
    from pathlib import Path
    from types import SimpleNamespace

    import yaml
    from snakemake.utils import update_config

    from mfpipe.experiments.fv.rules import task_inputs
    from mfpipe.experiments.prompts.rules import icl_task_data
    from mfpipe.workflow.config import apply_defaults
    from mfpipe.workflow.plan import Plan

    repo = Path(__file__).resolve().parents[1]
    full = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    update_config(full, yaml.safe_load((repo / "config" / "presets" / "gpt2-small.yaml").read_text()))
    apply_defaults(full)
    plan = Plan(full, repo / "src")
    for cwd, prefix in ((repo, "src/mfpipe/tasks/data/"), (repo / "config", "../src/mfpipe/tasks/data/")):
        monkeypatch.chdir(cwd)
        files = task_inputs(plan, SimpleNamespace(model="gpt2-small"))
        assert files == [f"{prefix}{t}.json" for t in full["fv"]["tasks"]] + [f"{prefix}unrelated-words.txt"]
        icl = icl_task_data(plan)
        assert icl and all(f.startswith(prefix) and Path(f).is_file() for f in icl), icl


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "llama", "qwen3", "gemma2", "olmo2"])
def test_the_residual_add_goes_through_the_site_on_every_architecture(model_type):
    """Issue 29 item 5: the residual-stream add at a layer and position (patch_resid) through the adapters' one
    read/patch site equals a plain torch pre-hook on the block, and a zero add leaves the logits bit-identical."""
    from mfpipe.models.tiny import make_tiny_model as tiny

    model = tiny(model_type, seed=2)
    ad = get_adapter(model)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    base = ad.run(ids, select=(), logits=True).logits
    assert torch.equal(ad.run(ids, select=(), logits=True, patch_resid=lambda l, r: r + 0.0).logits, base)
    d = torch.randn(ad.d_model, generator=torch.Generator().manual_seed(1))

    def add(layer, resid):
        if layer != 1:
            return None
        out = resid.clone()
        out[:, -1] += d
        return out

    got = ad.run(ids, select=(), logits=True, patch_resid=add).logits

    def pre(mod, args, kwargs):
        if args:
            x = args[0].clone()
            x[:, -1] += d
            return (x, *args[1:]), kwargs
        x = kwargs["hidden_states"].clone()
        x[:, -1] += d
        return args, {**kwargs, "hidden_states": x}

    h = blocks(model)[1].register_forward_pre_hook(pre, with_kwargs=True)
    with torch.no_grad():
        ref = model(ids).logits
    h.remove()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (got - base).abs().max() > 1e-3


# ------------------------------------------------------------------ head lists, the protocol tests, the settings
def test_a_head_list_on_a_tiny_gptj_and_its_recovery_by_aie(tok):
    """Item 1: a given head list runs as its own selection on a tiny GPT-J, and the recovery table's overlap of the
    pipeline's own AIE top k with the list equals a direct set comparison on the AIE scores of each split (whose
    top n_selected is the AIE selection)."""
    from mfpipe.experiments.fv import analysis as An

    tk, _ = tok
    model = make_tiny_model("gptj", seed=5, vocab_size=len(tk), bos_token_id=0, eos_token_id=0)
    ad = get_adapter(model)
    lst = ["L1H3", "L0H0", "L1H1", "L0H2", "L1H0"]
    null = torch.zeros(ad.n_layers, ad.n_heads, ad.d_head)
    cfg = dict(CFG, head_lists={"todd": {"shift": lst}, "other": {"another-task": ["L0H1"]}}, clean_sweep=[1])
    out = E.run_task(ad, _task(), tk, 0, null, cfg, context_length=T_CTX)
    assert "todd" in set(out["transfer"]["selection"]) and "other" not in set(out["transfer"]["selection"])
    assert out["info"]["head_lists"] == {"todd": lst}
    heads = [(int(x[1]), int(x[3])) for x in lst]
    rec = An.recovery_table(out["heads"], {("todd", "shift"): heads})
    assert len(rec) == 2
    for r in rec.itertuples():
        g = out["heads"][out["heads"]["split"] == r.split]
        aie = torch.zeros(ad.n_layers, ad.n_heads, dtype=torch.float64)
        aie[g["layer"].to_numpy(), g["head"].to_numpy()] = torch.tensor(g["aie"].to_numpy(copy=True))
        top = Hd.top_heads(aie.float(), len(lst))
        assert r.recovered == len(set(top) & set(heads)) and r.k == 5
        assert r.top5 == len(set(top[:5]) & set(heads[:5])) and r.top5_exact == (set(top[:5]) == set(heads[:5]))
        sel = set(zip(g.loc[g["sel_AIE"], "layer"], g.loc[g["sel_AIE"], "head"]))
        assert sel == set(Hd.top_heads(aie.float(), CFG["n_selected"]))
        mfa = set(zip(g.loc[g["sel_MFA"], "layer"], g.loc[g["sel_MFA"], "head"]))
        assert r.mfa_overlap == len(mfa & set(heads))
    with pytest.raises(ValueError, match="L2H0 is not a head of this model"):
        E.run_task(ad, _task(), tk, 0, null, dict(cfg, head_lists={"todd": {"*": ["L2H0"]}}), context_length=T_CTX)


def test_protocol_tests_pair_the_cells_and_tally_the_constructions():
    """Item 5: per-head vs summed over paired task x split x selection x construction cells (Wilcoxon), the
    summing penalty of AIE vs MFA (Mann-Whitney), and the r >= raw tally exactly and within 0.02."""
    from scipy import stats

    from mfpipe.experiments.fv import analysis as An

    rng = np.random.default_rng(0)
    rows, diffs, pen = [], [], {"AIE": [], "MFA": []}
    for task in ("a", "b"):
        for split in (0, 1, 2):
            for sel in ("AIE", "MFA", "random"):
                for cons in ("raw", "r"):
                    s_k, h_k = int(rng.integers(0, 40)), int(rng.integers(0, 40))
                    for prot, k in (("sum", s_k), ("per_head", h_k)):
                        rows.append(dict(task=task, split=split, protocol=prot, selection=sel, construction=cons,
                                         n=40, correct=k, in_category=k, seen_answer=0, p_answer=0.1, layer=0,
                                         scale=1.0))
                    if sel != "random":
                        diffs.append(h_k / 40 - s_k / 40)  # as the table computes them: accuracies first
                        pen[sel].append(-(h_k / 40 - s_k / 40))
    tr = pd.DataFrame(rows)
    p = An.protocol_tests(tr)
    assert p["n_cells"] == 24 and p["mean_difference"] == pytest.approx(np.mean(diffs))
    assert p["wilcoxon_p"] == pytest.approx(stats.wilcoxon(diffs).pvalue)
    assert p["penalty_AIE"] == pytest.approx(np.mean(pen["AIE"]))
    assert p["mannwhitney_p"] == pytest.approx(stats.mannwhitneyu(pen["AIE"], pen["MFA"]).pvalue)
    t = Tb.transfer_table(tr)
    tally = An.construction_tally(t).set_index("protocol")
    for prot in ("sum", "per_head"):
        w = t[(t["protocol"] == prot) & t["selection"].isin(["AIE", "MFA"])].pivot_table(
            index=["task", "selection"], columns="construction", values="accuracy")
        assert tally.loc[prot, "cells"] == 4
        assert tally.loc[prot, "r_at_least_raw"] == int((w["r"] >= w["raw"]).sum())
        assert tally.loc[prot, "r_within_tie"] == int((w["r"] >= w["raw"] - 0.02 - 1e-12).sum())


def test_fv_settings_give_each_model_its_null_and_head_lists():
    """Item 2: the null per model (a mapping; the default the mean field) and only the model's own head lists reach
    its job's params, so editing another model's changes nothing of this one's."""
    from types import SimpleNamespace

    from mfpipe.experiments.fv.rules import fv_settings

    fv = dict(DEFAULT_FV, null={"gpt-j-6b": "type_mean"}, head_lists=[
        {"name": "todd", "model": "gpt-j-6b", "heads": ["L15H5", "L9H14"], "tasks": None},
        {"name": "mine", "model": "gpt-j-6b", "heads": ["L1H1"], "tasks": ["antonym"]},
        {"name": "mine", "model": "gpt2-small", "heads": ["L9H8"], "tasks": None}])
    plan = SimpleNamespace(config={"fv": fv})
    j, g = fv_settings(plan, "gpt-j-6b"), fv_settings(plan, "gpt2-small")
    assert j["null"] == "type_mean" and g["null"] == "mean_field"
    assert j["head_lists"] == {"todd": {"*": ["L15H5", "L9H14"]}, "mine": {"antonym": ["L1H1"]}}
    assert g["head_lists"] == {"mine": {"*": ["L9H8"]}}
    assert E.task_head_lists(j["head_lists"], "antonym", 28, 16) == {"todd": [(15, 5), (9, 14)], "mine": [(1, 1)]}
    assert E.task_head_lists(j["head_lists"], "capital", 28, 16) == {"todd": [(15, 5), (9, 14)]}
    assert "tasks" not in j and "models" not in j
    fv2 = dict(fv, null={"gpt-j-6b": "type_mean", "default": "type_mean"})
    assert fv_settings(SimpleNamespace(config={"fv": fv2}), "gpt2-small")["null"] == "type_mean"


def test_the_gptj_preset_names_todds_ten_heads_and_its_measured_null():
    """Item 1 and 2 on the presets: every preset's shared block carries Todd et al.'s ten heads for GPT-J (verbatim,
    App. fv-validations) and GPT-J's measured null; the schema takes them and refuses a reserved name."""
    from pathlib import Path

    import yaml

    from mfpipe.workflow.config import ConfigError, validate_schema

    repo = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    fv = yaml.safe_load((repo / "config" / "presets" / "gpt-j-6b.yaml").read_text())["fv"]
    todd = ["L15H5", "L9H14", "L12H10", "L8H1", "L11H0", "L13H13", "L8H0", "L14H9", "L9H2", "L24H6"]
    assert fv["head_lists"] == [{"name": "todd", "model": "gpt-j-6b", "heads": todd}]
    assert fv["null"] == {"gpt-j-6b": "type_mean"}
    validate_schema(dict(cfg, fv=fv))
    # the run's plan (as the Snakefile builds it) gives GPT-J's job the todd arm and the measured null, and no other
    # model either of them (tests/test_presets.py plans that job on the offline hub cache)
    from snakemake.utils import update_config

    from mfpipe.experiments.fv.rules import fv_settings, targets
    from mfpipe.workflow.config import check_config
    from mfpipe.workflow.plan import Plan

    for preset, model in (("gpt-j-6b", "gpt-j-6b"), ("gpt2-small", "gpt2-small")):
        full = yaml.safe_load((repo / "config" / "config.yaml").read_text())
        update_config(full, yaml.safe_load((repo / "config" / "presets" / f"{preset}.yaml").read_text()))
        validate_schema(full)
        check_config(full)
        plan = Plan(full, repo / "src")
        got = fv_settings(plan, model)
        if model == "gpt-j-6b":
            assert got["head_lists"] == {"todd": {"*": todd}} and got["null"] == "type_mean"
        else:
            assert got["head_lists"] == {} and got["null"] == "mean_field"
        assert f"results/tables/fv_clean_{model}_main.md" in targets(plan)
    with pytest.raises(ConfigError, match="head_lists"):
        validate_schema(dict(cfg, fv=dict(fv, head_lists=[{"name": "MFA", "model": "m", "heads": ["L0H0"]}])))


def test_the_lens_analysis_through_products_equals_the_store():
    """Issue 58: the category and per-prompt decodes (rank_rows, prompt_rank_rows) through Jacobian-vector products on
    the J-lens store's sample (jlens.decode: jvp; mfpipe.experiments.fv.decode.lens_rows) equal those through the
    stored J: the same rows, the same ranks; the raw lens's rows are bit for bit the same; rows asked in another order
    than recorded are refused."""
    from types import SimpleNamespace

    from mfpipe.experiments.fv import decode as Dc
    from mfpipe.jlens import lens as JL
    from mfpipe.jlens.jvp import JLensSample

    ad = get_adapter(make_tiny_model("gpt2", seed=5))
    L, H, dh, V = ad.n_layers, ad.n_heads, ad.d_head, ad.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    windows = np.random.default_rng(3).integers(0, V, size=(6, 12))
    store = JL.estimate_jlens(ad, windows, n_positions=10, seed=2, batch_size=4, progress=False)
    sample = JLensSample(windows, n_positions=10, seed=2, batch_size=4, chunk=6)
    O = Hd.out_slices(ad)
    n = 5
    d0 = {"zbar": torch.randn(L, H, dh, generator=g), "r": torch.randn(L, H, dh, generator=g),
          "sel": {"AIE": [(0, 1)], "MFA": [(1, 0), (0, 2)]},
          "clean": [SimpleNamespace(answer=int(a)) for a in range(3, 3 + n)],
          "reads": SimpleNamespace(z=torch.randn(n, L, H, dh, generator=g))}
    pops = {"seen": np.arange(4), "held-out": np.arange(4, 8), "out-of-task": np.arange(8, 14),
            "unrelated": np.arange(20, 26)}
    null = torch.randn(L, H, dh, generator=g)
    task = SimpleNamespace(name="t")

    def rows(decode):
        return (Dc.rank_rows(task, decode, pops, d0, O, [("AIE", "raw"), ("MFA", "r")], 1),
                Dc.prompt_rank_rows(task, decode, d0, null, O))

    by_store = [pd.DataFrame(r) for r in Dc.lens_rows(ad, store, rows)]
    by_products = [pd.DataFrame(r) for r in Dc.lens_rows(ad, sample, rows)]
    for a, b in zip(by_store, by_products):
        assert len(a) == len(b) and set(a["lens"]) == {"raw", "J"}
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
    calls = []

    def swapped(decode):  # the second pass asks in another order than the first
        calls.append(1)
        out = rows(decode)
        if len(calls) == 2:
            decode(torch.zeros(1, ad.d_model), 0, "block")
        return out

    with pytest.raises(RuntimeError, match="same order"):
        Dc.lens_rows(ad, sample, swapped)


def test_a_hybrid_selects_and_injects_only_heads_of_its_attention_layers(tok, tmp_path):
    """A hybrid (a tiny Jamba: Mamba at layers 0 and 2) has no heads at its other layers: their reads are NaN
    (``cue_reads``). Before stop 81 the random control drew from every (layer, head) slot, so its summed vector was NaN
    and every logit NaN (a control that "failed" for no measured reason), and the top-k selections could take a
    Mamba layer's slot; AIE patched reads no head has. Now every selection, the random one included, is of attention
    layers, AIE is NaN elsewhere, and a vector of a head without finite reads is refused by name."""
    tk, texts = tok
    model = tiny_jamba(seed=3)
    model.resize_token_embeddings(len(tk))
    model.config.bos_token_id = 0
    ad = get_adapter(model)
    att = ad.attention_layers
    assert tuple(att) == (1, 3)
    tracked, st = _stats_store(model, ad, tk, texts * 2, tmp_path / "stats.zarr")
    cfg = dict(CFG, n_selected=5, n_splits=1, head_lists={}, clean_sweep=[2])
    out = E.run_task(ad, _task(), tk, 0, lambda cue: Hd.corpus_null(st, tracked, cue), cfg, context_length=T_CTX)
    h = out["heads"]
    for sel in ("MFA", "AIE", "raw-magnitude", "random"):
        chosen = h[h[f"sel_{sel}"]]
        assert len(chosen) == 5 and set(chosen["layer"]) <= set(att), (sel, chosen[["layer", "head"]])
    assert h.loc[~h["layer"].isin(att), "aie"].isna().all() and h.loc[h["layer"].isin(att), "aie"].notna().all()
    tr = out["transfer"]
    random_sum = tr[(tr["protocol"] == "sum") & (tr["selection"] == "random")]
    assert len(random_sum) and random_sum["p_answer"].notna().all(), random_sum
    # the draw on a model whose every layer has attention is the one it was before the layers were given
    assert Hd.random_heads(4, 4, 5, [1, 0xAA, 0], range(4)) == Hd.random_heads(4, 4, 5, [1, 0xAA, 0])
    vectors = torch.full((4, 4, ad.d_head), float("nan"))
    vectors[1] = 1.0
    O = torch.ones(4, 4, ad.d_head, ad.d_model)
    assert torch.isfinite(Inj.summed_vector(vectors, [(1, 0), (1, 3)], O)).all()
    with pytest.raises(ValueError, match="L0H2 have no finite vector"):
        Inj.summed_vector(vectors, [(1, 0), (0, 2)], O)
