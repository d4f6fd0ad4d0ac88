"""The notebook API (mfpipe.notebook: collect_stats, mean_field, substitute, deviation, decode) on tiny random models:
the paper's identities, slow references for its per-position outputs, the model left as it was given, nnsight's
LanguageModel as input, and one clear error for each bad input. Its equality with the pipeline's own stores on the
ci config's windows is checked on the ci run (tests/test_workflow.py, helper tests/notebook_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mfpipe
from mfpipe.models.tiny import VOCAB, make_tiny_model
from mfpipe.notebook.inputs import NotebookError

# nnsight 0.8 deprecates LanguageModel for TransformersModel; users still pass it
pytestmark = pytest.mark.filterwarnings("ignore:LanguageModel is deprecated")


def windows(model, n=48, T=16, seed=0, vocab=24):
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, vocab, size=(n, T))
    toks[:, 0] = model.config.bos_token_id
    return toks


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def setup(request):
    model = make_tiny_model(request.param)
    toks = windows(model)
    ds = mfpipe.collect_stats(model, toks, n_tracked=12, progress=False, batch_size=8)
    return model, toks, ds


def test_collect_stats_is_the_store_of_the_pipeline_code(setup):
    """Rows of P sum to 1; the store's layout and provenance; splitting the windows into shards changes nothing but
    the float rounding of the sums; the tracked set is the corpus stage's selection."""
    from mfpipe.corpus.tracked import count_types, select_tracked
    from mfpipe.stats.api import MeanFieldStats

    model, toks, ds = setup
    seen = ds["query_count"] > 0
    np.testing.assert_allclose(ds["P"].sum("key").where(seen).dropna("query").values, 1.0, atol=1e-6)
    assert set(ds.data_vars) >= {"P", "nbar", "centroid", "mu", "zbar", "context_count", "position_count"}
    a = ds.attrs
    assert a["source"].startswith("in-memory") and a["half"] == "in-memory" and a["n_windows"] == len(toks)
    assert a["n_tracked"] == 12 and a["bos_id"] == model.config.bos_token_id and "numerics" in a
    want = select_tracked(count_types([toks], VOCAB), 12, model.config.bos_token_id, decode=str)
    assert a["tracked_fingerprint"] == want.fingerprint
    assert ds["query_token_id"].values.tolist() == want.type_ids.tolist()
    shards = mfpipe.collect_stats(model, [toks[:20], toks[20:]], tracked=want, progress=False)
    assert shards.attrs["n_shards"] == 2 and shards.attrs["tracked_fingerprint"] == want.fingerprint
    for v in ("P", "mu", "centroid", "nbar"):
        np.testing.assert_allclose(shards[v].values, ds[v].values, rtol=1e-5, atol=1e-6)
    assert MeanFieldStats(ds).W().sizes["key"] == 14


def test_deviation_terms_sum_and_match_the_prompt_classes_occurrence_form(setup):
    """M_cov + M_ctx = D exactly; at every valid position D, M_cov, M_ctx equal the occurrence form over every
    (query, key) pair (mfpipe.experiments.prompts.classes.deviation_forward) within float32 rounding; positions
    without a query type are NaN."""
    from mfpipe.experiments.prompts.classes import deviation_forward
    from mfpipe.models.adapters import get_adapter
    from mfpipe.notebook.meanfield import MeanField
    from mfpipe.stats.api import MeanFieldStats

    model, toks, ds = setup
    dev = mfpipe.context_deviation(model, ds, toks[:6], reads="head")
    D, ok = dev["D"].values, dev["valid"].values
    assert ok.any() and not ok[:, 0].any()  # BOS is never a query
    np.testing.assert_allclose((dev["M_cov"] + dev["M_ctx"]).values[ok], D[ok], rtol=0, atol=1e-12)
    assert np.isnan(D[~ok]).all()
    adapter = get_adapter(model.eval())
    kernel = MeanField(MeanFieldStats(ds)).kernel(VOCAB).to(adapter.device)
    kb, qt = kernel.buckets(toks[:6])
    ref, valid, _ = deviation_forward(adapter, kernel, torch.as_tensor(toks[:6]), kb, qt)
    for m in ("D", "M_cov", "M_ctx"):
        r = ref[m].numpy()  # [B, T, L, H]
        np.testing.assert_allclose(dev[m].values[ok], r[ok], rtol=1e-4, atol=2e-5)
    assert np.array_equal(ok.all(-1), valid.numpy())
    # D from z and ẑ: 1 - cos through each head's output projection
    z, zh = (torch.as_tensor(dev[k].values) for k in ("z", "zhat"))
    O = torch.stack([adapter.out_proj_slices(l).float() for l in range(adapter.n_layers)])  # [L, H, dh, d]
    zr, hr = (torch.einsum("btlhd,lhde->btlhe", x.nan_to_num(), O) for x in (z, zh))
    cos = torch.nn.functional.cosine_similarity(zr.double(), hr.double(), dim=-1).numpy()
    np.testing.assert_allclose(1 - cos[ok], D[ok], atol=1e-5)
    resid = mfpipe.context_deviation(model, ds, toks[:6], reads="resid")
    np.testing.assert_allclose(resid["z"].values[ok], zr.numpy()[ok], rtol=1e-5, atol=1e-6)


def test_mean_field_is_invariant_to_permuting_the_context(setup):
    """ẑ at a query depends on its context's type counts only: permuting positions 1..q-1 leaves it unchanged."""
    model, toks, ds = setup
    mf = mfpipe.mean_field(ds)
    q = toks.shape[1] - 1
    full = mf.zhat(toks)
    i = int(np.flatnonzero(full["substituted"][:, q])[0])  # a window whose last position has a mean field
    x = toks[i]
    perm = x.copy()
    perm[1:q] = x[1:q][np.random.default_rng(3).permutation(q - 1)]
    assert not np.array_equal(perm, x)
    a, b = mf.zhat(x), mf.zhat(perm)
    np.testing.assert_allclose(a["zhat"][0, q].values, full["zhat"][i, q].values, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(a["zhat"][0, q].values, b["zhat"][0, q].values, rtol=1e-5, atol=1e-6)
    assert np.isfinite(a["zhat"][0, q].values).all() and np.isnan(a["zhat"][0, 0].values).all()
    assert mf.W.dims == ("layer", "head", "query", "key") and mf.mu.dims == ("layer", "head", "key", "head_dim")
    assert a.attrs["tracked_fingerprint"] == ds.attrs["tracked_fingerprint"]


def test_substitute_adds_up_and_leaves_the_model_as_given(setup):
    """Per-position losses average to L_model and L_MF; D_MF is the mean of the per-position deviation; windows of
    two lengths are padded; the model comes back in its own mode and attention implementation."""
    model, toks, ds = setup
    model.train()
    impl = model.config._attn_implementation
    sub = mfpipe.substitute(model, ds, [toks[0], toks[1], toks[2, :9]])
    assert model.training and model.config._attn_implementation == impl
    model.eval()
    n = int(sub["n_predictions"])
    assert n == 2 * 15 + 8 and sub.sizes["position"] == 16 and int((sub["token_id"] >= 0).sum()) == 2 * 16 + 9
    np.testing.assert_allclose(float(np.nansum(sub["loss_model"])) / n, float(sub["L_model"]), rtol=1e-12)
    np.testing.assert_allclose(float(np.nansum(sub["loss_mf"])) / n, float(sub["L_MF"]), rtol=1e-12)
    np.testing.assert_allclose(float(sub["deviation"].where(sub["substituted"]).mean()), float(sub["D_MF"]), rtol=1e-12)
    assert sub["head_deviation"].dims == ("layer", "head") and sub.attrs["source"] == "in-memory (mfpipe.substitute)"


def test_decode_raw_and_jlens(setup):
    """The raw lens is the unembedding's top tokens; the J-lens at the last block with J = I is the raw lens."""
    import xarray as xr

    model, _, _ = setup
    v = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    raw = mfpipe.decode(model, v.numpy(), 0, k=5)
    from mfpipe.models.adapters import get_adapter

    want = get_adapter(model.eval()).unembed(v).topk(5, dim=-1).indices.numpy()
    assert raw["token_id"].values.tolist() == want.tolist() and raw.sizes == {"vector": 2, "rank": 5}
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    J = xr.Dataset({"J": (("point", "layer", "out", "in"), np.broadcast_to(np.eye(d), (2, L + 1, d, d)).copy())},
                   coords={"point": ["block", "attn"], "layer": np.arange(L + 1)})
    J.attrs.update(model="tiny", revision="r1")
    jl = mfpipe.decode(model, v.numpy(), L, lens="jlens", jlens=J, point="block", k=5)
    assert jl["token_id"].values.tolist() == want.tolist()
    np.testing.assert_allclose(jl["logit"].values, raw["logit"].values, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotebookError, match="needs jlens="):
        mfpipe.decode(model, v.numpy(), 0, lens="jlens")
    # provenance: the model and its weights, the lens, where it reads, the J-lens store's model
    from mfpipe.notebook.identity import weights_fingerprint

    fp = weights_fingerprint(model)
    assert raw.attrs["source"] == "in-memory (mfpipe.decode)" and raw.attrs["weights_fingerprint"] == fp
    assert raw.attrs["lens"] == "raw" and raw.attrs["layer"] == 0 and raw.attrs["n_vectors"] == 2
    assert jl.attrs["layer"] == L and jl.attrs["point"] == "block" and jl.attrs["jlens_model"] == "tiny"
    assert jl.attrs["jlens_revision"] == "r1" and "layer" not in mfpipe.decode(model, v.numpy(), k=5).attrs


@pytest.mark.parametrize("cls", ["TransformersModel", "LanguageModel"])
def test_an_nnsight_model_gives_the_same_numbers(setup, cls):
    """nnsight 0.8.1's TransformersModel and the LanguageModel it deprecates both wrap the model: equal numbers."""
    import nnsight

    model, toks, ds = setup
    lm = getattr(nnsight, cls)(model, tokenizer=_tokenizer())
    a = mfpipe.substitute(model, ds, toks[:3])
    b = mfpipe.substitute(lm, ds, toks[:3])
    assert float(a["delta_L"]) == float(b["delta_L"]) and np.array_equal(a["head_deviation"], b["head_deviation"])
    assert "token" in b.coords and "token" not in a.coords  # the wrapper's tokenizer names the tokens


def test_windows_of_different_lengths_keep_the_input_order(setup):
    """Windows of several lengths run in one forward per length, and come back in the order given: window i of every
    result is the i-th input, equal to that window run alone (slow reference: one call per window)."""
    model, toks, ds = setup
    given = [toks[2, :9], toks[0], toks[1, :5], toks[3], toks[4, :9]]
    lengths = [len(w) for w in given]
    sub = mfpipe.substitute(model, ds, given)
    dev = mfpipe.context_deviation(model, ds, given)
    zh = mfpipe.mean_field(ds).zhat(given)
    for res in (sub, dev, zh):
        assert res.sizes["window"] == 5 and (res["token_id"] >= 0).sum("position").values.tolist() == lengths
    for i, w in enumerate(given):
        T = len(w)
        assert sub["token_id"].values[i, :T].tolist() == w.tolist() and (sub["token_id"].values[i, T:] == -1).all()
        one_sub, one_dev = mfpipe.substitute(model, ds, w), mfpipe.context_deviation(model, ds, w)
        np.testing.assert_allclose(sub["loss_model"].values[i, :T], one_sub["loss_model"].values[0], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(sub["deviation"].values[i, :T], one_sub["deviation"].values[0], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(dev["D"].values[i, :T], one_dev["D"].values[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(zh["zhat"].values[i, :T], mfpipe.mean_field(ds).zhat(w)["zhat"].values[0],
                                   rtol=1e-6, atol=1e-7)
    assert dev.attrs["tokens_fingerprint"] == sub.attrs["tokens_fingerprint"] != \
        mfpipe.context_deviation(model, ds, given[::-1]).attrs["tokens_fingerprint"]  # the windows in the given order


def test_the_weights_fingerprint_tells_models_apart(setup):
    """collect_stats records the weights' and the tokenizer's fingerprints; the fingerprint is the same for the same
    weights (rebuilt, or cast to bfloat16 and back) and differs for another seed or a few training steps on."""
    from mfpipe.notebook.identity import tokenizer_fingerprint, weights_fingerprint

    model, toks, ds = setup
    fp = weights_fingerprint(model)
    assert ds.attrs["weights_fingerprint"] == fp and "tokenizer_fingerprint" not in ds.attrs
    import copy

    again = make_tiny_model(model.config.model_type)
    assert weights_fingerprint(again) == fp
    assert weights_fingerprint(copy.deepcopy(again).to(torch.bfloat16)) == fp  # a bfloat16 copy of the checkpoint
    assert weights_fingerprint(make_tiny_model(model.config.model_type, seed=1)) != fp
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1e-3 * p.abs().mean() * torch.randn_like(p))
    assert weights_fingerprint(again) != fp
    tok = _tokenizer()
    tok("w1 w2", truncation=True, max_length=1)  # runtime truncation state is not part of the tokenizer
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(_tokenizer()) != tokenizer_fingerprint(_tokenizer(1))


def _tokenizer(shift: int = 0):
    """A word-level tokenizer of the tiny vocabulary (``shift``: the same words on other ids, another tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": (i + shift) % (VOCAB - 1) for i in range(VOCAB - 1)}
    tok = Tokenizer(models.WordLevel(words | {"<s>": VOCAB - 1}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="<s>", eos_token="<s>")


def test_a_padded_embedding_keeps_the_pipelines_tracked_set():
    """A model whose embedding has more rows than its tokenizer has tokens (Pythia's 50304 for 50277): the corpus stage
    sizes the tracked set by the tokenizer, and the notebook did by the embedding, so its tracked fingerprint differed
    from the run's and the run's own tracked set was refused (found at stop 81)."""
    from mfpipe.corpus.tracked import count_types, select_tracked
    from mfpipe.notebook.inputs import text_windows

    model = make_tiny_model("gpt2", vocab_size=VOCAB + 32)
    model.config.bos_token_id = VOCAB - 1
    tok = _tokenizer()
    text = " ".join(f"w{i % 9 + 1}" for i in range(300))
    ds = mfpipe.collect_stats(model, [text], tokenizer=tok, n_tracked=5, context_length=20, progress=False)
    windows = text_windows([text], tok, VOCAB - 1, 20)  # the windows the store was measured on, as the corpus stage
    run = select_tracked(count_types(windows, len(tok)), 5, VOCAB - 1, decode=str)  # selects by them (BOS never)
    assert len(tok) == VOCAB < model.config.vocab_size and ds.attrs["tracked_fingerprint"] == run.fingerprint


def test_texts_are_tokenized_and_bos_led():
    model = make_tiny_model("gpt2")
    model.config.bos_token_id = VOCAB - 1
    tok = _tokenizer()
    text = " ".join(f"w{i % 9 + 1}" for i in range(300))
    ds = mfpipe.collect_stats(model, [text], tokenizer=tok, n_tracked=5, context_length=20, progress=False)
    assert ds.attrs["context_length"] == 20 and ds.attrs["n_windows"] == 300 // 19
    assert ds.attrs["bos_id"] == VOCAB - 1
    from mfpipe.notebook.identity import tokenizer_fingerprint

    assert ds.attrs["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    dev = mfpipe.context_deviation(model, ds, ["w1 w2 w3 w1 w2", "w4 w5"], tokenizer=tok)
    assert dev["token_id"].values[:, 0].tolist() == [VOCAB - 1, VOCAB - 1]
    assert dev["token"].values[0].tolist() == ["<s>", "w1", "w2", "w3", "w1", "w2"]


def _bad_fixture():
    """What the bad inputs are made from: the tiny GPT-2, its windows, its statistics (token ids), statistics of texts
    with the test tokenizer (which record its fingerprint), another tokenizer, a J-lens store of identity matrices."""
    import xarray as xr

    model = make_tiny_model("gpt2")
    model.config.bos_token_id = VOCAB - 1  # the test tokenizer's <s>
    toks = windows(model)
    ds = mfpipe.collect_stats(model, toks, n_tracked=12, progress=False)
    tok = _tokenizer()
    text = " ".join(f"w{i % 9 + 1}" for i in range(300))
    tds = mfpipe.collect_stats(model, [text], tokenizer=tok, n_tracked=5, context_length=20, progress=False)
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    J = xr.Dataset({"J": (("point", "layer", "out", "in"), np.broadcast_to(np.eye(d), (2, L + 2, d, d)).copy())},
                   coords={"point": ["block", "attn"], "layer": np.arange(L + 2)})
    return {"model": model, "toks": toks, "ds": ds, "tok": tok, "tds": tds, "other_tok": _tokenizer(shift=1),
            "J_other": J, "bos": VOCAB - 1}


@pytest.fixture(scope="module")
def bad():
    return _bad_fixture()


def _bert():
    import transformers

    return transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        is_decoder=True))


def _another_revision(model):
    """The same model a few training steps on: every weight moved by ~1e-3 of its scale (another checkpoint)."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1e-3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return other


def _hub_store(f):
    """Statistics as a workflow store records them (no weights fingerprint; the commit the revision resolved to)."""
    ds = f["ds"].copy()
    ds.attrs = {k: v for k, v in ds.attrs.items() if k != "weights_fingerprint"} | {"revision_commit": "a" * 40}
    return ds


def _hub_model(f):
    """The same weights, loaded (as transformers records it) from another commit."""
    model = make_tiny_model("gpt2")
    model.config.bos_token_id = VOCAB - 1
    model.config._commit_hash = "b" * 40
    return model


def _foreign_tracked(f):
    from mfpipe.corpus.tracked import TrackedSet

    ids = np.setdiff1d(np.arange(1, 8), [f["bos"]])[:5]
    return TrackedSet(ids, [str(i) for i in ids], np.ones(5), f["bos"], VOCAB)


def _vector_of_another_model(f):
    import xarray as xr

    other = make_tiny_model("gpt2", seed=1)
    other.config.bos_token_id = VOCAB - 1
    dev = mfpipe.context_deviation(other, mfpipe.collect_stats(other, f["toks"], n_tracked=12, progress=False),
                                f["toks"][:2], reads="resid")
    v = dev["z"].sel(layer=1, head=0)[0]
    v = v[np.isfinite(v.values).all(-1)][0]
    assert isinstance(v, xr.DataArray) and v.attrs["weights_fingerprint"]
    return v


def _no_bos(f):
    x = f["toks"][:2].copy()
    x[1, 0] = 3
    return x


D = 64  # the tiny models' hidden size
# (id, the call on the fixture, what the one line must say): every bad input a notebook user can make
BAD_INPUTS = [
    ("empty array (issue 60: numpy's zero-size error)",
     lambda f: mfpipe.collect_stats(f["model"], np.zeros((0, 10)), progress=False), r"windows #0 are empty"),
    ("empty int array", lambda f: mfpipe.context_deviation(f["model"], f["ds"], np.zeros((0, 10), dtype=int)),
     r"windows #0 are empty"),
    ("empty list", lambda f: mfpipe.collect_stats(f["model"], [], progress=False), r"no windows: the list is empty"),
    ("empty list to substitute", lambda f: mfpipe.substitute(f["model"], f["ds"], []), r"no windows"),
    ("window of length 1", lambda f: mfpipe.context_deviation(f["model"], f["ds"], f["toks"][:2, :1]),
     r"length 1: a window needs BOS and at least one token"),
    ("empty text", lambda f: mfpipe.context_deviation(f["model"], f["tds"], ["w1 w2", ""], tokenizer=f["tok"]),
     r"text #1 holds no tokens"),
    ("token ids beyond the vocabulary", lambda f: mfpipe.substitute(f["model"], f["ds"], [[f["bos"], VOCAB + 5]]),
     rf"token id {VOCAB + 5} is outside the model's vocabulary of {VOCAB}"),
    ("negative token ids (results' padding)", lambda f: mfpipe.context_deviation(f["model"], f["ds"], [[f["bos"], 3, -1]]),
     r"window 0 of #0 holds token id -1 at position 2: ids are >= 0"),
    ("float array", lambda f: mfpipe.context_deviation(f["model"], f["ds"], f["toks"][:2].astype(float)),
     r"windows #0 hold float64, not integer token ids"),
    ("float tensor", lambda f: mfpipe.mean_field(f["ds"]).zhat(torch.as_tensor(f["toks"][:2], dtype=torch.float32)),
     r"windows #0 hold float32, not integer token ids"),
    ("3-D array", lambda f: mfpipe.context_deviation(f["model"], f["ds"], f["toks"][None, :2]),
     r"windows #0 have shape \(1, 2, 16\): give \[n, T\]"),
    ("ragged nested list", lambda f: mfpipe.substitute(f["model"], f["ds"], [[[f["bos"], 1, 2], [f["bos"], 3]]]),
     r"ragged nested list"),
    ("texts and ids mixed", lambda f: mfpipe.substitute(f["model"], f["ds"], [[f["bos"], 1], "w1"]),
     r"mixes texts and token ids"),
    ("not windows at all", lambda f: mfpipe.substitute(f["model"], f["ds"], None), r"cannot read windows from NoneType"),
    ("window without BOS", lambda f: mfpipe.substitute(f["model"], f["ds"], _no_bos(f)),
     r"window 1 of #0 starts with token 3, not BOS"),
    ("window longer than the model's positions",
     lambda f: mfpipe.context_deviation(f["model"], f["ds"], np.full((1, 129), f["bos"])),
     r"windows of 129 tokens exceed the 128 positions"),
    ("texts without a tokenizer", lambda f: mfpipe.collect_stats(f["model"], ["some text"], progress=False),
     r"texts need a tokenizer: pass tokenizer= \(an nnsight TransformersModel brings its own\)"),
    ("a model mfpipe cannot place", lambda f: mfpipe.context_deviation(_bert(), f["ds"], f["toks"][:2]),
     r"mfpipe cannot analyse this BertLMHeadModel: .*model_type='bert': cannot place .*mfpipe conformance"),
    ("not a model", lambda f: mfpipe.substitute(torch.nn.Linear(2, 2), f["ds"], f["toks"][:2]),
     r"Linear is not a transformers causal LM or an nnsight TransformersModel"),
    ("not a tokenizer", lambda f: mfpipe.collect_stats(f["model"], ["w1"], tokenizer="gpt2", progress=False),
     r"tokenizer= is a str, not a tokenizer"),
    ("statistics of another shape",
     lambda f: mfpipe.context_deviation(make_tiny_model("gpt2", n_layer=3), f["ds"], f["toks"][:2]),
     r"statistics \(in memory, model .*\) was computed for n_layers=2"),
    ("statistics of another model of the same shape",
     lambda f: mfpipe.substitute(make_tiny_model("gpt2", seed=1), f["ds"], f["toks"][:2]),
     r"statistics \(in memory\) was computed on other weights than this model's"),
    ("statistics of another revision", lambda f: mfpipe.context_deviation(_another_revision(f["model"]), f["ds"],
                                                                       f["toks"][:2]),
     r"computed on other weights than this model's .*another checkpoint, revision or fine-tune"),
    ("a workflow store of another commit", lambda f: mfpipe.substitute(_hub_model(f), _hub_store(f), f["toks"][:2]),
     r"computed on revision .* \(commit a{40}\), the model was loaded from commit b{40}"),
    ("statistics of another tokenizer",
     lambda f: mfpipe.context_deviation(f["model"], f["tds"], ["w1 w2"], tokenizer=f["other_tok"]),
     r"computed with another tokenizer"),
    ("mean field of another tokenizer", lambda f: mfpipe.mean_field(f["tds"]).zhat(["w1 w2"], f["other_tok"]),
     r"computed with another tokenizer"),
    ("statistics of another tracked set",
     lambda f: mfpipe.substitute(f["model"], f["ds"], f["toks"][:2], tracked=_foreign_tracked(f)),
     r"were computed with tracked set .* not the given"),
    ("not statistics", lambda f: mfpipe.mean_field(42), r"statistics must be a Dataset, a store path"),
    ("a Dataset that is no statistics", lambda f: mfpipe.substitute(f["model"], f["ds"][["nbar"]], f["toks"][:2]),
     r"this Dataset is not a statistics store"),
    ("a store path that does not exist", lambda f: mfpipe.mean_field("/nonexistent/stats.zarr"),
     r"statistics store /nonexistent/stats.zarr does not exist .*mfpipe.collect_stats"),
    ("no tracked types", lambda f: mfpipe.collect_stats(f["model"], f["toks"], n_tracked=0, progress=False),
     r"the tracked set is empty"),
    ("empty tracked=", lambda f: mfpipe.collect_stats(f["model"], f["toks"], tracked=[], progress=False),
     r"the tracked set is empty"),
    ("tracked token not in the tokenizer",
     lambda f: mfpipe.collect_stats(f["model"], ["w1 w2 w3"], tokenizer=f["tok"], tracked=["nope"], context_length=3,
                                  progress=False),
     r"tracked= holds 'nope', no token of the tokenizer"),
    ("tracked type absent from the windows (its mean value undefined: NaN reached every mean field before stop 81)",
     lambda f: mfpipe.collect_stats(f["model"], f["toks"], tracked=[_absent_id(f)], progress=False),
     r"tracked= holds 1 types that never occur in these windows \('\d+'\): their mean values are undefined"),
    ("n_tracked not whole", lambda f: mfpipe.collect_stats(f["model"], f["toks"], n_tracked=2.7, progress=False),
     r"n_tracked=2.7: give a whole number"),
    ("partial_mantissa_bits 0",
     lambda f: mfpipe.collect_stats(f["model"], f["toks"], partial_mantissa_bits=0, progress=False),
     r"partial_mantissa_bits=0: give None \(float32 partials\) or a whole number of mantissa bits 1..23"),
    ("tracked id beyond the vocabulary",
     lambda f: mfpipe.collect_stats(f["model"], f["toks"], tracked=[10**6], progress=False),
     rf"tracked= holds 1000000: give token ids 0..{VOCAB - 1}"),
    ("batch_size 0", lambda f: mfpipe.context_deviation(f["model"], f["ds"], f["toks"][:2], batch_size=0),
     r"batch_size=0: give a whole number >= 1"),
    ("context_length 1", lambda f: mfpipe.collect_stats(f["model"], ["w1 w2"], tokenizer=f["tok"], context_length=1,
                                                        progress=False), r"context_length=1"),
    ("min_count 0", lambda f: mfpipe.mean_field(f["ds"], min_count=0), r"min_count=0: give a whole number >= 1"),
    ("reads unknown", lambda f: mfpipe.context_deviation(f["model"], f["ds"], f["toks"][:2], reads="z"),
     r"reads='z': give None, 'head' or 'resid'"),
    ("a device that is no device", lambda f: mfpipe.context_deviation(f["model"], f["ds"], f["toks"][:2], device="gpu7"),
     r"device='gpu7' is no torch device"),
    ("a device not on this machine",
     lambda f: mfpipe.collect_stats(f["model"], f["toks"], device="cuda:99", progress=False),
     r"device='cuda:99' is not available on this machine"),
    ("decode: layer outside the model", lambda f: mfpipe.decode(f["model"], np.ones(D), 7),
     r"layer=7 is outside 0..2 of the model"),
    ("decode: a vector of another width", lambda f: mfpipe.decode(f["model"], np.ones(16), 1),
     r"vector has shape \(1, 16\): give \[d\] or \[n, d\] with d = 64 \(context_deviation's reads='head'"),
    ("decode: NaN (a position that is no valid query)", lambda f: mfpipe.decode(f["model"], np.full(D, np.nan), 1),
     r"vector holds NaN or inf"),
    ("decode: not numbers", lambda f: mfpipe.decode(f["model"], ["a", "b"], 1), r"no array of numbers"),
    ("decode: a vector of another model", lambda f: mfpipe.decode(f["model"], _vector_of_another_model(f), 1),
     r"the vector was computed on other weights than this model's"),
    ("decode: k 0", lambda f: mfpipe.decode(f["model"], np.ones(D), 1, k=0), r"k=0: give a whole number >= 1"),
    ("decode: unknown lens", lambda f: mfpipe.decode(f["model"], np.ones(D), 1, lens="tuned"),
     r"lens='tuned': give 'raw' or 'jlens'"),
    ("decode: J-lens without its store", lambda f: mfpipe.decode(f["model"], np.ones(D), 1, lens="jlens"),
     r"lens='jlens' needs jlens="),
    ("decode: J-lens without a layer", lambda f: mfpipe.decode(f["model"], np.ones(D), lens="jlens", jlens=f["J_other"]),
     r"lens='jlens' needs layer="),
    ("decode: J-lens store of another model",
     lambda f: mfpipe.decode(f["model"], np.ones(D), 1, lens="jlens", jlens=f["J_other"]),
     r"the J-lens store has layers 0..3, the model 0..2: it belongs to another model"),
    ("decode: J-lens store of other weights of the same shape (accepted before stop 81)",
     lambda f: mfpipe.decode(f["model"], np.ones(D), 1, lens="jlens",
                             jlens=f["J_other"].assign_attrs(weights_fingerprint="0123456789abcdef")),
     r"the J-lens store was computed on other weights than this model's"),
    ("decode: J-lens store path that does not exist",
     lambda f: mfpipe.decode(f["model"], np.ones(D), 1, lens="jlens", jlens="/nonexistent/jlens.zarr"),
     r"/nonexistent/jlens.zarr"),
    ("decode: unknown point", lambda f: mfpipe.decode(f["model"], np.ones(D), 1, lens="jlens", jlens=f["J_other"],
                                                      point="mlp"), r"point='mlp': give 'attn'"),
]


def _absent_id(f) -> int:
    """A token id below the vocabulary that none of the fixture's windows holds."""
    held = set(np.unique(np.asarray(f["toks"])).tolist())
    return next(i for i in range(1, VOCAB) if i not in held)


@pytest.mark.parametrize("call,match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_each_bad_input_gets_one_notebook_error_line(bad, call, match):
    """One NotebookError whose one line names the problem and what to do: no traceback of numpy, torch, the adapter
    or the readers below it (no chained exception a notebook would print above it)."""
    with pytest.raises(NotebookError, match=match) as info:
        call(bad)
    e = info.value
    assert "\n" not in str(e), str(e)
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)


def test_the_bad_inputs_are_bad_only_where_they_say(bad):
    """Non-triviality of the list above: the same calls with the one thing put right run (so each error is the
    input's, not the fixture's)."""
    f = bad
    m, ds, toks = f["model"], f["ds"], f["toks"]
    mfpipe.context_deviation(m, ds, toks[:2])
    mfpipe.substitute(make_tiny_model("gpt2"), ds, toks[:2])  # the same weights built again: accepted
    mfpipe.context_deviation(m, f["tds"], ["w1 w2"], tokenizer=_tokenizer())  # an equal tokenizer built again
    mfpipe.mean_field(f["tds"]).zhat(["w1 w2"], f["tok"])
    hub = _hub_model(f)
    hub.config._commit_hash = "a" * 40
    mfpipe.substitute(hub, _hub_store(f), toks[:2])
    assert mfpipe.decode(m, np.ones(D), 2).attrs["layer"] == 2


def test_decode_through_products_equals_the_store(setup):
    """Issue 58: decode(lens="jlens") with a J-lens sample (mfpipe.jlens.jvp.JLensSample: Jacobian-vector products
    on the store's positions, no store) gives the store's top tokens and logits (1e-5 of their scale), and records
    that it ran so."""
    from mfpipe.jlens import lens as JL
    from mfpipe.jlens.jvp import JLensSample
    from mfpipe.models.adapters import get_adapter

    model, _, _ = setup
    V = model.config.vocab_size
    windows = np.random.default_rng(0).integers(0, V, size=(4, 10))
    J = JL.estimate_jlens(get_adapter(model.eval()), windows, n_positions=6, seed=1, batch_size=3, progress=False)
    J.attrs.update(model="tiny", revision="r1")
    sample = JLensSample(windows, n_positions=6, seed=1, batch_size=3, attrs={"corpus_fingerprint": "fp"})
    v = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).numpy()
    for layer, point in ((0, "attn"), (1, "block")):
        a = mfpipe.decode(model, v, layer, lens="jlens", jlens=sample, point=point, k=5)
        b = mfpipe.decode(model, v, layer, lens="jlens", jlens=J, point=point, k=5)
        assert a["token_id"].values.tolist() == b["token_id"].values.tolist()
        scale = float(np.abs(b["logit"].values).max())
        np.testing.assert_allclose(a["logit"].values, b["logit"].values, rtol=0, atol=1e-5 * scale)
    assert a.attrs["jlens_decode"] == "jvp" and a.attrs["jlens_n_positions"] == 6 and a.attrs["jlens_seed"] == 1
    assert a.attrs["jlens_corpus_fingerprint"] == "fp" and "jlens_decode" not in b.attrs
