"""Issue 59 item 3: hybrids, whose blocks are attention or another mixer. A tiny Jamba (Mamba blocks at layers 0 and
2, attention blocks at 1 and 3, a mixture of experts in the attention blocks) is placed with its layer kinds; its
statistics equal per-position loops over the model's own forward (HF's ``output_attentions`` /
``output_hidden_states`` and plain torch hooks on modules named here by hand) on the attention layers, with NaN rows
and the layer's kind at the others; writing the model's own reads back leaves its loss unchanged, and the mean-field
write-back equals a torch pre-hook on the attention layers' output projections; the rollout runs a Mamba block as
the model's own one-position forward; its per-layer tables name each layer's kind. Recurrent-Gemma (a recurrent
block beside attention in blocks of one class) passes every conformance check."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from layer_loops import assert_store_equals_loops, loop_means
from stats_reference import BOS, tracked_for, zipf_windows
from tiny_models import tiny_jamba

from mfpipe.models.adapters import describe, get_adapter
from mfpipe.models.tiny import random_model

KINDS = ("mamba", "attention", "mamba", "attention")


@pytest.fixture(scope="module")
def jamba():
    return tiny_jamba()


def _hooked_forward(model, ids):
    """The model's own forward with plain torch hooks on the attention blocks' modules (paths written here by hand):
    per layer, the probabilities, values, reads, attention output, MLP output (None at a Mamba layer), and the
    hidden states (float64)."""
    layers = model.model.layers
    got: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for l, block in enumerate(layers):
        if not hasattr(block, "self_attn"):
            continue
        a = block.self_attn
        handles += [
            a.v_proj.register_forward_hook(lambda m, i, o, l=l: got.__setitem__(("v", l), o)),
            a.o_proj.register_forward_pre_hook(lambda m, i, l=l: got.__setitem__(("z", l), i[0])),
            a.register_forward_hook(lambda m, i, o, l=l: got.__setitem__(("a", l), o[0])),
            block.feed_forward.register_forward_hook(
                lambda m, i, o, l=l: got.__setitem__(("m", l), o[0] if isinstance(o, tuple) else o)),
        ]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    att = iter(out.attentions)  # the attention layers' only
    B, T = ids.shape
    per = []
    for l in range(len(layers)):
        if ("v", l) not in got:
            per.append(None)
            continue
        v = got[("v", l)].view(B, T, 2, 16).repeat_interleave(2, dim=2)  # [B,T,H,dh]: GQA 2 KV heads -> 4 heads
        per.append(dict(probs=next(att).double(), values=v.double(), reads=got[("z", l)].view(B, T, 4, 16).double(),
                        attn_out=got[("a", l)].double(), mlp_out=got[("m", l)].double()))
    hidden = [h.double() for h in out.hidden_states]
    return per, hidden


def _loops(model, tokens, tracked, L):
    """Per-position loops (tests/layer_loops.py) over the hooked forward; NaN at the Mamba layers (no attention)."""
    per, hidden = _hooked_forward(model, torch.as_tensor(tokens.astype(np.int64)))
    return loop_means(per, hidden, tokens, tracked, L, 4, 16, 64)


def test_a_hybrid_is_placed_with_its_layer_kinds(jamba):
    s = describe(jamba)
    assert s.layer_kinds == KINDS and s.attn == "self_attn" and s.mlp == "feed_forward"
    ad = get_adapter(jamba)
    assert ad.attention_layers == (1, 3) and ad.hybrid
    with pytest.raises(ValueError, match="layer 0 is a mamba layer, not attention"):
        ad.value_map(0, torch.zeros(2, 64))
    # a family's own words are no mixer kind: Recurrent-Gemma's RecurrentGemmaAttention is attention
    from transformers import RecurrentGemmaConfig

    from mfpipe.models.tiny import shrink_config

    cfg = shrink_config(RecurrentGemmaConfig())  # block_types cycled: grown to three layers, one of them attention
    assert describe(random_model(cfg, seed=0)).layer_kinds == ("recurrent", "recurrent", "attention")


def test_statistics_equal_the_loops_on_attention_layers_and_are_nan_elsewhere(jamba):
    from mfpipe.stats import accumulate_shard, finalize

    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    ad = get_adapter(jamba)
    sums = accumulate_shard(jamba, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    ds = finalize(sums, tracked, {"model": "tiny-jamba", "layer_kinds": list(ad.layer_kinds)}, dtype=np.float64)
    ref = _loops(jamba, tokens, tracked, 4)
    assert list(ds["layer_kind"].values) == list(KINDS)
    assert_store_equals_loops(ds, ref, 4)
    for name in ("P", "mu", "zbar", "attn_out_mean", "resid_mid_mean", "mlp_out_mean", "ln_in_mean"):
        v = ds[name].values
        assert np.isnan(v[[0, 2]]).all(), name  # the Mamba layers: no attention, NaN rows (never 0)
        assert not np.isnan(v[[1, 3]]).all(), name
    assert np.isfinite(ds["centroid"].values[:, :tracked.n]).all()  # the residual entering every block is measured
    np.testing.assert_allclose(ds["P"].values[[1, 3]].sum(-1), 1.0, atol=1e-5)


def test_substitution_on_a_hybrid_patches_attention_layers_only(jamba, tmp_path):
    from mfpipe.meanfield.kernel import kernel_from_store
    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    ad = get_adapter(jamba)
    tokens = zipf_windows(8, seed=1)
    tracked = tracked_for(tokens)
    ids = torch.as_tensor(tokens.astype(np.int64))
    seen = []

    def own(layer, reads):
        seen.append(layer)
        return reads

    with torch.no_grad():
        want = jamba(ids, use_cache=False).logits
    got = ad.run(ids, patch_reads=own, logits=True, loss=True)
    assert sorted(set(seen)) == [1, 3]  # patch_reads is called at the attention layers only
    # own reads written back: the logits bit-identical, the loss the unpatched run's
    assert torch.equal(got.logits, want) and float(got.loss) == float(ad.run(ids, loss=True).loss)
    sums = accumulate_shard(jamba, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    meta = {"model": "tiny-jamba", "revision": "r", "half": "stats", "corpus_fingerprint": "-",
            "layer_kinds": list(ad.layer_kinds)}
    kernel = kernel_from_store(open_stats(write_store(finalize(sums, tracked, meta), tmp_path / "s.zarr")),
                               tracked, min_count=1)
    assert kernel.attention_layers == (1, 3)
    zhat, sub = kernel.zhat(*kernel.buckets(tokens))
    assert int(sub.sum()) > 10 and all(float(zhat[l].abs().max()) == 0 for l in (0, 2))

    def replace(layer, reads):
        return torch.where(sub[..., None, None], zhat[layer].to(reads.dtype), reads)

    got = ad.run(ids, patch_reads=replace, logits=True).logits
    handles = [jamba.model.layers[l].self_attn.o_proj.register_forward_pre_hook(
        lambda m, a, l=l: (replace(l, a[0].view(*a[0].shape[:2], 4, 16)).reshape(a[0].shape),)) for l in (1, 3)]
    try:
        with torch.no_grad():
            ref = jamba(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    assert float((got - ref).abs().max()) <= 1e-5 and float((got - jamba(ids).logits).abs().max()) > 1e-4


def test_the_rollout_runs_a_mamba_block_as_the_models_one_position_forward(jamba):
    from mfpipe.experiments.rollout.algorithm import bos_residuals, rollout
    from mfpipe.models.adapters.hybrid import mixer_block

    ad = get_adapter(jamba)
    types = torch.tensor([3, 5, 7])
    caps, finals = [], []
    ad.capture(types[:, None], caps.append, finals.append)  # each type as a sequence of one token
    for l in (0, 2):
        nxt = caps[l + 1].resid_in[:, 0]
        assert float((mixer_block(ad, l, caps[l].resid_in[:, 0]) - nxt).abs().max()) == 0.0
    K = np.full((4, 4, 3, 5), np.nan)
    K[[1, 3]] = 0.0
    K[[1, 3], :, :, 3] = 1.0  # every query reads the <bos> column only
    got = rollout(ad, K, bos_residuals(ad, BOS), type_ids=types.numpy())
    assert got.shape == (5, 3, 64) and np.isfinite(got).all()
    c1 = mixer_block(ad, 0, torch.as_tensor(got[0]))
    np.testing.assert_allclose(got[1], c1.numpy(), rtol=0, atol=0)  # layer 0, Mamba: the block's own forward


def _rollout_setup(jamba):
    """(the adapter, the statistics of six Zipf windows, the rollout's setup on them) of the tiny Jamba."""
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.stats import MeanFieldStats, accumulate_shard, finalize

    ad = get_adapter(jamba)
    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(jamba, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    meta = {"model": "tiny-jamba", "revision": "r", "half": "stats", "layer_kinds": list(ad.layer_kinds)}
    st = MeanFieldStats(finalize(sums, tracked, meta, dtype=np.float64))
    return ad, st, RO.prepare(ad, st, st)


def test_the_layer_ablations_of_a_hybrid_are_of_its_attention_layers(jamba):
    """Table 1's ``Pavg`` (P averaged over layers) and ``P0only`` (the first layer's P at every layer) on a hybrid:
    before stop 81 they averaged or copied the Mamba layers' NaN rows, so both kernels were NaN throughout, passed the
    row check (NaN fails no comparison), rolled out to NaN after the first attention block, and the table averaged the
    one depth left -- the Mamba block, the same for every kernel -- over "4 layers", in bold, as the best. Now both are
    of the attention layers (NaN, unread, at the others), a NaN where the rollout reads a kernel is refused, the
    context-free ablation runs, and ``n_layers`` counts the depths averaged."""
    from mfpipe.experiments.rollout import kernels as K
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.experiments.rollout import tables as RT

    ad, st, setup = _rollout_setup(jamba)
    P = np.asarray(st.P().transpose("layer", "head", "query", "key").values)
    att = list(ad.attention_layers)
    for name, want in (("Pavg", P[att].mean(0)), ("P0only", P[att[0]])):
        Kr = np.asarray(RO.build_kernel(name, setup))
        for l in range(4):
            if l in att:
                np.testing.assert_allclose(Kr[l], want, rtol=1e-12, atol=0, err_msg=f"{name} layer {l}")
            else:
                assert np.isnan(Kr[l]).all(), (name, l)
    bad = P.copy()
    bad[1, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="layer 1: kernel has non-finite entries"):
        K.check_row_stochastic(bad, atol=1e-4, skip=[0, 2])
    df = RO.run_rollouts(jamba, ad, None, None, kernels=["mean_field", "Pavg", "P0only", "context_free_kernel"],
                         setup=setup)
    assert np.isfinite(df["value"]).all(), df[~np.isfinite(df["value"])]
    summary = RT.rollout_summary(df)
    assert (summary["n_layers"] == 4).all(), summary
    part = df[~((df["kernel"] == "Pavg") & (df["depth"] > 1))]  # a rollout NaN beyond depth 1, as before the fix
    broken = pd.concat([part, df[(df["kernel"] == "Pavg") & (df["depth"] > 1)].assign(value=np.nan)])
    s = RT.rollout_summary(broken).set_index("kernel")
    assert s.loc["Pavg", "n_layers"] == 1 and s.loc["mean_field", "n_layers"] == 4


@pytest.mark.parametrize("family", ["jamba", "recurrent_gemma"])
def test_hybrid_families_pass_every_conformance_check(family):
    from mfpipe.models.census import census_row

    row = census_row(family)
    assert row.accepted, row


def test_the_per_layer_tables_of_a_hybrid_name_each_layers_kind(jamba):
    """In-process, what the Jamba's ci-DAG run checked in the default run until stop 79 (tests/test_moe_workflow.py,
    now on demand): the rollout accounting's per-block tables (teacher-forced attention, the nested estimators) name
    each layer's kind, with no reading at a Mamba block (NaN: before, its empty clouds scored a cosine of 0) and
    finite ones at the attention blocks, and their Markdown keeps and labels those rows; the head ranking names every
    head's layer kind, a Mamba layer's heads without S̄, ranked after every attention head."""
    import pandas as pd
    import xarray as xr

    from mfpipe.experiments.ranking.heads import heads_table
    from mfpipe.experiments.rollout import accounting as AC
    from mfpipe.experiments.rollout import tables as RT

    ad, st, setup = _rollout_setup(jamba)
    mamba, attention = [0, 2], [1, 3]
    teacher_forced = AC.teacher_forced_table(ad, setup)
    for df in (teacher_forced, AC.error_decomposition_table(ad, setup)):
        assert df.groupby("layer").layer_kind.first().tolist() == list(KINDS)
        assert df[df.layer.isin(mamba)].value.isna().all()
        assert np.isfinite(df[df.layer.isin(attention) & (df.metric == "cosine")].value).all()
    wide = RT.long_to_wide(teacher_forced, "layer")
    md = RT.wide_markdown(wide, "layer", ["frac_depth", "cosine", "rsa", "rel_error", "norm_ratio"])
    rows = [line for line in md.splitlines() if " | mamba | " in line]
    assert len(rows) == 2 and all(line.endswith("| – | – | – | – |") for line in rows), md
    # the ranking of a deviation store whose Mamba layers have no S̄ (pass 2 writes NaN there)
    rng = np.random.default_rng(0)
    s_bar = rng.random((4, 4))
    s_bar[mamba] = np.nan
    dev = xr.Dataset({k: (("layer", "head"), s_bar * (i + 1)) for i, k in enumerate(("S_bar", "M_cov", "M_ctx", "D"))}
                     | {"S_bar_half": (("half", "layer", "head"), np.stack([s_bar, s_bar]))},
                     coords={"layer_kind": ("layer", list(KINDS))}, attrs={"model": "tiny-jamba", "revision": "r"})
    ranked = heads_table(dev)
    assert ranked.groupby("layer").layer_kind.first().tolist() == list(KINDS)
    assert ranked.head(8).layer.isin(attention).all() and ranked.tail(8).S_bar.isna().all()
    assert isinstance(ranked, pd.DataFrame) and ranked["rank"].tolist() == list(range(1, 17))


def test_the_prompt_meters_and_the_deviation_store_of_a_hybrid_count_its_attention_layers(jamba, tmp_path):
    """A hybrid's other layers have no heads (their meters NaN): Exp. 1's instance meter and the prompt classes average
    D_MF, M_cov and M_ctx over the attention layers' heads (over every layer they were NaN, and the meter's summary
    then read 0), and pass 2's store counts its contexts and scored types at an attention layer (at layer 0, a Mamba
    block, they read 0)."""
    from mfpipe.deviation import shards as DP
    from mfpipe.experiments.prompts import classes as PC
    from mfpipe.experiments.prompts import meter as PM
    from mfpipe.experiments.prompts import sets as PS
    from mfpipe.meanfield.kernel import kernel_from_store
    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    ad = get_adapter(jamba)
    tokens = zipf_windows(8, seed=1)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(jamba, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    meta = {"model": "tiny-jamba", "revision": "r", "half": "stats", "corpus_fingerprint": "-",
            "layer_kinds": list(ad.layer_kinds)}
    st = open_stats(write_store(finalize(sums, tracked, meta), tmp_path / "s.zarr"))
    kernel = kernel_from_store(st, tracked, min_count=1)
    ev = zipf_windows(4, seed=2)
    seqs, _ = PS.meter_sequences(ev, np.repeat(np.arange(4)[:, None], ev.shape[1], axis=1), 3, bos_id=tracked.bos_id,
                                 seed=0)
    t = PM.meter_tables(PM.instance_meter(ad, kernel, seqs, batch_size=2), n_bins=3)
    heads, summary = t["heads"], t["summary"].iloc[0]
    att = heads[heads.layer.isin([1, 3])]
    assert heads[heads.layer.isin([0, 2])].D_copy1.isna().all() and np.isfinite(att.D_copy1).all()
    # D_MF of a copy: the mean over the attention layers' heads of each head's mean D there
    for c in ("copy1", "copy2"):
        assert summary[f"D_MF_{c}"] > 0 and summary[f"D_MF_{c}"] == pytest.approx(att[f"D_{c}"].mean(), rel=1e-9)
    ind, rnd = PS.induction_and_random_prompts(PC.queryable_types(kernel), tracked.bos_id, ev.shape[1], 3, n_random=4,
                                               seed=0)
    df, _ = PC.measure_prompts(ad, kernel, ind + rnd)
    assert np.isfinite(df[["D_MF", "M_cov", "M_ctx"]].to_numpy()).all() and (df.D_MF > 0).all()
    np.testing.assert_allclose(df.M_cov + df.M_ctx, df.D_MF, atol=1e-6)
    doc = np.repeat(np.arange(8)[:, None] // 2, tokens.shape[1], axis=1)
    s, m = DP.deviation_shard(jamba, ad, tokens, doc, tracked, st, min_count=1, batch_size=4, progress=False)
    ds = DP.deviation_dataset(s, m, tracked, min_occurrences=3)
    count = ds["count"].sum("half").values  # [layer, query]
    assert count[[0, 2]].sum() == 0 and ds.attrs["n_contexts"] == count[1].sum() == count[3].sum() > 0
    assert ds.attrs["n_types_scored"] == int((count[1] >= 3).sum()) > 0
