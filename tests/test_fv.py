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
from tiny_models import make_tiny_model

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
    stream = [i for t in texts * 3 for i in tk(t + "\n", add_special_tokens=False)["input_ids"]]
    n_win = len(stream) // (T_CTX - 1)
    windows = np.concatenate([np.zeros((n_win, 1), np.int64),
                              np.asarray(stream[: n_win * (T_CTX - 1)]).reshape(n_win, -1)], axis=1)
    tracked = tracked_for(windows, n=60, bos=0, vocab=len(tk))
    sums = accumulate_shard(model, ad, windows, tracked, batch_size=8, device="cpu", progress=False)
    meta = {"model": "tiny", "revision": "r1", "half": "stats", "corpus": "t", "corpus_fingerprint": "fp",
            "model_type": ad.model_type}
    st = open_stats(write_store(finalize(sums, tracked, meta), tmp_path_factory.mktemp("fv") / "stats.zarr"))
    return model, ad, tk, tracked, st


CFG = dict(n_pairs=20, n_extract=8, n_splits=2, n_shots=3, n_clean=6, n_corrupted=3, n_selected=3,
           sum_scales=[1.0, 4.0], head_scales=[1.0, 3.0], answer_prefix=" ", batch_size=16, seed=1)


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
    np.testing.assert_allclose(got.numpy(), ref, atol=2e-6)
    assert p0 == pytest.approx(np.mean(base), abs=1e-6)


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

        hd = blocks(model)[1].register_forward_pre_hook(pre, with_kwargs=True)
        with torch.no_grad():
            ref = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
        hd.remove()
        assert pa[0, j] == pytest.approx(ref, abs=1e-5)

        def patch(layer, reads):
            out = reads.clone()
            for l, h in heads:
                if l == layer:
                    out[0, -1, h] += 2.0 * v[l, h]
            return out

        with patched_reads(model, patch), torch.no_grad():
            ref = torch.softmax(model(ids).logits[0, -1].double(), -1)[p.answer].item()
        assert pa[1, j] == pytest.approx(ref, abs=1e-5)


# ------------------------------------------------------------------ the experiment and its tables
def test_run_task_tables_and_figure(setup, tmp_path):
    model, ad, tk, tracked, st = setup
    out = E.run_task(ad, _task(), tk, 0, lambda cue: Hd.corpus_null(st, tracked, cue), CFG,
                     other_categories=[np.arange(5, 15)], context_length=T_CTX)
    tr = out["transfer"]
    assert set(tr["protocol"]) == {"zero-shot", "few-shot", "sum", "per_head"}
    assert set(tr.loc[tr["protocol"] == "sum", "selection"]) == set(E.SELECTIONS)
    assert (tr["n"] == 12).all() and (tr["correct"] <= tr["n"]).all() and (tr["in_category"] >= tr["correct"]).all()
    sw = out["sweep"]
    assert sw.loc[sw["protocol"] == "sum", "chosen"].sum() == 4  # one (layer, scale) for the four pipelines
    h = out["heads"]
    assert len(h) == 2 * ad.n_layers * ad.n_heads and h.groupby("split")["sel_MFA"].sum().eq(3).all()
    assert (h.groupby("split")["sel_AIE"].sum() == 3).all()
    rk = out["ranks"]
    assert {"raw"} <= set(rk["lens"]) and rk["median_rank_seen"].notna().all()
    results = {k: out[k] for k in ("transfer", "heads", "sweep", "ranks", "prompt_ranks")}
    tabs = Tb.fv_tables({k: v for k, v in results.items()}, [out["info"]])
    assert {"matrix_sum", "matrix_per_head", "stability", "category"} <= set(tabs)
    m = tabs["transfer"]
    row = m[(m["protocol"] == "sum") & (m["selection"] == "MFA") & (m["construction"] == "r")].iloc[0]
    assert row["n"] == 24 and row["ci_lo"] <= row["accuracy"] <= row["ci_hi"]
    md = Tb.matrix_markdown(tabs["transfer"], tabs["stability"], "sum", "tiny", "r1")
    assert "AIE∩MFA" in md and "shift" in md
    from mfpipe.experiments.fv import figures as Fg

    Fg.plot_transfer(tabs["transfer"], tmp_path / "fv.png", title="tiny")
    assert (tmp_path / "fv.png").stat().st_size > 1000


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
