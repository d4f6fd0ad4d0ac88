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
    dev = mfpipe.deviation(model, ds, toks[:6], reads="head")
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
    resid = mfpipe.deviation(model, ds, toks[:6], reads="resid")
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
    jl = mfpipe.decode(model, v.numpy(), L, lens="jlens", jlens=J, point="block", k=5)
    assert jl["token_id"].values.tolist() == want.tolist()
    np.testing.assert_allclose(jl["logit"].values, raw["logit"].values, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotebookError, match="needs jlens="):
        mfpipe.decode(model, v.numpy(), 0, lens="jlens")


def test_an_nnsight_language_model_gives_the_same_numbers(setup):
    from nnsight import LanguageModel

    model, toks, ds = setup
    lm = LanguageModel(model, tokenizer=_tokenizer())
    a = mfpipe.substitute(model, ds, toks[:3])
    b = mfpipe.substitute(lm, ds, toks[:3])
    assert float(a["delta_L"]) == float(b["delta_L"]) and np.array_equal(a["head_deviation"], b["head_deviation"])


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB - 1)} | {"<s>": VOCAB - 1}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="<s>", eos_token="<s>")


def test_texts_are_tokenized_and_bos_led():
    model = make_tiny_model("gpt2")
    model.config.bos_token_id = VOCAB - 1
    tok = _tokenizer()
    text = " ".join(f"w{i % 9 + 1}" for i in range(300))
    ds = mfpipe.collect_stats(model, [text], tokenizer=tok, n_tracked=5, context_length=20, progress=False)
    assert ds.attrs["context_length"] == 20 and ds.attrs["n_windows"] == 300 // 19
    assert ds.attrs["bos_id"] == VOCAB - 1
    dev = mfpipe.deviation(model, ds, ["w1 w2 w3 w1 w2", "w4 w5"], tokenizer=tok)
    assert dev["token_id"].values[:, 0].tolist() == [VOCAB - 1, VOCAB - 1]
    assert dev["token"].values[0].tolist() == ["<s>", "w1", "w2", "w3", "w1", "w2"]


def test_bad_input_gets_one_clear_error(setup):
    import transformers

    from mfpipe.corpus.tracked import TrackedSet

    model, toks, ds = setup
    no_bos = toks[:2].copy()
    no_bos[1, 0] = 3
    with pytest.raises(NotebookError, match=r"window 1 of #0 starts with token 3, not BOS"):
        mfpipe.substitute(model, ds, no_bos)
    with pytest.raises(NotebookError, match=r"length 1: a window needs BOS and at least one token"):
        mfpipe.deviation(model, ds, toks[:2, :1])
    with pytest.raises(NotebookError, match="the tracked set is empty"):
        mfpipe.collect_stats(model, toks, n_tracked=0, progress=False)
    n_pos = model.config.max_position_embeddings
    with pytest.raises(NotebookError, match=f"windows of {n_pos + 1} tokens exceed the {n_pos} positions"):
        mfpipe.deviation(model, ds, np.full((1, n_pos + 1), model.config.bos_token_id))
    with pytest.raises(NotebookError, match="the tracked set is empty"):
        mfpipe.collect_stats(model, toks, tracked=[], progress=False)
    with pytest.raises(NotebookError, match="texts need a tokenizer"):
        mfpipe.collect_stats(model, ["some text"], progress=False)
    other = make_tiny_model(model.config.model_type, num_hidden_layers=3) if model.config.model_type != "gpt2" \
        else make_tiny_model("gpt2", n_layer=3)
    with pytest.raises(NotebookError, match=r"statistics \(in memory, model .*\) was computed for n_layers=2"):
        mfpipe.deviation(other, ds, toks[:2])
    bos = int(ds.attrs["bos_id"])
    ids = np.setdiff1d(np.arange(1, 8), [bos])[:5]
    foreign = TrackedSet(ids, [str(i) for i in ids], np.ones(5), bos, VOCAB)
    with pytest.raises(NotebookError, match="were computed with tracked set .* not the given"):
        mfpipe.substitute(model, ds, toks[:2], tracked=foreign)
    bert = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        is_decoder=True))
    with pytest.raises(ValueError, match=r"model_type='bert': cannot place .*mfpipe conformance"):
        mfpipe.deviation(bert, ds, toks[:2])
    with pytest.raises(NotebookError, match="not a transformers causal LM or an nnsight LanguageModel"):
        mfpipe.substitute(torch.nn.Linear(2, 2), ds, toks[:2])
