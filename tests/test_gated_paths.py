"""Issue 59: the paths that map a head's read to the residual (its write through O_h) on an attention that gates its
reads (mfpipe.models.adapters.gate), on a tiny Qwen3-Next (tests/test_gated_hybrid.py's): the J-lens agreement's head
writes, the function vectors' cue reads (their gates, the scores' and the per-prompt decode's writes), the context
lens's deviation vector Δ_resid, the notebook's ``context_deviation(reads="resid")`` and the statistics' ``zhat`` /
``zbar`` mapped through ``out_proj_slices``. Each is compared with the model's own gated read: the output projection's
input under a plain torch forward pre-hook (the gate: the query projection's per-head second half, sigmoid, under a
forward hook). Each test also checks that the read through O_h alone is far off, so it fails without the gate.

The same paths on a tiny BitNet, whose attention norms every head's reads together before the output projection
(``attn_sub_norm``, mfpipe.models.adapters.normed): its factor of a position's reads, ``weight / rms(reads)`` written
here by hand from the norm's input under a pre-hook, is the gate of that position; a mean-field read mapped through
O_h (the statistics' ``zhat`` / ``zbar``) takes the factor of those reads, every head's."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from stats_reference import BOS, VOCAB, tracked_for, zipf_windows

from mfpipe.models.adapters import get_adapter
from mfpipe.models.tiny import random_model

pytestmark = pytest.mark.filterwarnings("ignore:LanguageModel is deprecated")
H, KV, DH, D = 4, 2, 16, 64


@pytest.fixture(scope="module", params=["qwen3_next", "bitnet"])
def qwen(request):
    """tests/test_gated_hybrid.py's tiny Qwen3-Next: gated delta-nets at layers 0 and 2, gated attention at 1 and 3;
    or a tiny BitNet of four attention layers, each norming its heads' reads together."""
    from transformers import BitNetConfig, Qwen3NextConfig

    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=128, num_hidden_layers=4, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=DH, max_position_embeddings=128, bos_token_id=BOS,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if request.param == "bitnet":
        cfg = BitNetConfig(**common)
    else:
        cfg = Qwen3NextConfig(layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
                              linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                              linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **common)
    cfg._attn_implementation = "eager"
    model = random_model(cfg, seed=3)
    if request.param == "bitnet":  # weights away from 1, so that the factor is no plain 1 / rms
        with torch.no_grad():
            for block in model.model.layers:
                block.self_attn.attn_sub_norm.weight.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(9))
    return model, get_adapter(model)


def _sub_norm(norm, z):
    """BitNet's attn_sub_norm's factor of reads ``z [..., H, dh]``, by hand: weight / rms over every head's reads."""
    flat = z.flatten(-2).float()
    g = norm.weight.float() * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return g.unflatten(-1, (H, DH)).double()


def _hooked(model, ids) -> dict:
    """Per attention layer ``l``: ``("w", l)`` the output projection's input [B,T,H,dh] (the read times the model's own
    gate) and ``("g", l)`` the gate [B,T,H,dh], float64, from plain torch hooks."""
    got, handles = {}, []
    for l, block in enumerate(model.model.layers):
        if not hasattr(block, "self_attn"):
            continue
        a = block.self_attn
        handles.append(a.o_proj.register_forward_pre_hook(
            lambda m, i, l=l: got.__setitem__(("w", l), i[0].view(*i[0].shape[:2], H, DH).double())))
        if hasattr(a, "attn_sub_norm"):  # BitNet: the factor of the reads the norm reads
            handles.append(a.attn_sub_norm.register_forward_pre_hook(lambda m, i, l=l: got.__setitem__(
                ("g", l), _sub_norm(m, i[0].view(*i[0].shape[:2], H, DH)))))
        else:
            handles.append(a.q_proj.register_forward_hook(lambda m, i, o, l=l: got.__setitem__(
                ("g", l), torch.sigmoid(o.view(*o.shape[:-1], H, 2 * DH)[..., DH:]).double())))
    try:
        with torch.no_grad():
            model(torch.as_tensor(np.asarray(ids, dtype=np.int64)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def _close(got, want, what, rtol=1e-4):
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    err = float((got - want).abs().max())
    assert err <= rtol * max(1.0, float(want.abs().max())), (what, err)


def _far(ungated, want, what):
    """The read through O_h alone is off by a large share of the write: the test would fail without the gate."""
    ungated, want = torch.as_tensor(ungated).double(), torch.as_tensor(want).double()
    assert float((ungated - want).abs().max()) > 0.05 * float(want.abs().max()), what


def _O(ad, l):
    return ad.out_proj_slices(l).double()


def test_jlens_agreement_decodes_the_heads_gated_writes(qwen):
    from mfpipe.jlens.agreement import decode_vectors
    from mfpipe.jlens.lens import sample_positions

    model, ad = qwen
    windows = zipf_windows(6, seed=2)
    got = decode_vectors(ad, windows, n_decode=12, seed=4, batch_size=4)
    win, pos = sample_positions(6, windows.shape[1], 12, 4)
    ref = _hooked(model, windows)
    for l in ad.attention_layers:
        w = ref["w", l][win, pos]  # [n, H, dh]
        want = torch.einsum("nhe,hed->nhd", w, _O(ad, l)).reshape(-1, ad.d_model)
        _close(got["attn", l], want, f"attn {l}")
        reads = w / ref["g", l][win, pos]
        _far(torch.einsum("nhe,hed->nhd", reads, _O(ad, l)).reshape(-1, ad.d_model), want, f"attn {l}")


def test_function_vector_writes_go_through_each_cues_gate(qwen):
    from mfpipe.experiments.fv import heads as Hd
    from mfpipe.experiments.fv.decode import prompt_rank_rows
    from mfpipe.experiments.fv.prompts import FVPrompt

    model, ad = qwen
    windows = zipf_windows(3, seed=7)[:, :9]
    prompts = [FVPrompt(tokens=w.astype(np.int64), answer=5, pair=i) for i, w in enumerate(windows)]
    reads = Hd.cue_reads(ad, prompts, batch_size=2)
    ref = _hooked(model, windows)
    O = Hd.out_slices(ad)
    one = Hd.written_slices(O, reads.g[:1])  # one prompt: its own cue's gate, exactly
    norms = Hd.head_norms(reads.z[0], one)
    for l in ad.attention_layers:
        w, g = ref["w", l][:, -1], ref["g", l][:, -1]
        _close(reads.g[:, l], g, f"gate {l}")
        _close(reads.z[:, l] * reads.g[:, l], w, f"gated read {l}")
        want = torch.einsum("he,hed->hd", w[0], _O(ad, l)).norm(dim=-1)
        _close(norms[l], want, f"head norm {l}")
        _far(Hd.head_norms(reads.z[0], O)[l], want, f"head norm {l}")
    # the per-prompt decode: each prompt's (z - ẑ) through its own cue's gate and O_h
    null = torch.randn(ad.n_layers, H, DH, generator=torch.Generator().manual_seed(1))
    seen = []

    def decode(resid, l, point):
        seen.append((l, resid.clone()))
        return {"raw": torch.zeros(len(resid), 8)}

    d0 = dict(clean=prompts, reads=reads, sel={"MFA": [(1, 0)]})
    prompt_rank_rows(type("T", (), {"name": "t"})(), decode, d0, null, O)
    for k, (l, resid) in enumerate(seen):
        if l in ad.attention_layers:
            h = k % H
            want = (ref["w", l][:, -1, h] - null[l, h].double() * ref["g", l][:, -1, h]) @ _O(ad, l)[h]
            _close(resid, want, f"prompt decode L{l}H{h}")
            _far((reads.z[:, l, h] - null[l, h]).double() @ _O(ad, l)[h], want, f"prompt decode L{l}H{h}")


@pytest.fixture(scope="module")
def qwen_stats(qwen):
    import mfpipe

    model, ad = qwen
    tokens = zipf_windows(12, seed=1)
    ds = mfpipe.collect_stats(model, tokens, tracked=tracked_for(tokens), progress=False, batch_size=6)
    return tokens, ds


def test_context_lens_and_notebook_writes_go_through_the_querys_gate(qwen, qwen_stats):
    import mfpipe
    from mfpipe.deviation.contexts import context_meters
    from mfpipe.experiments.prompts.rerun import ContextRerun
    from mfpipe.notebook.meanfield import MeanField
    from mfpipe.stats.api import MeanFieldStats

    model, ad = qwen
    tokens, ds = qwen_stats
    toks = tokens[:3]
    kernel = MeanField(MeanFieldStats(ds)).kernel(int(model.config.vocab_size)).to(ad.device)
    cm = context_meters(ad, kernel, toks, reads=True)
    ref = _hooked(model, toks)
    rows = []
    for l in ad.attention_layers:
        ok = cm["valid"][:, :, l]
        _close(cm["gate"][:, :, l][ok], ref["g", l][ok], f"context gate {l}")
        _close(cm["z"][:, :, l][ok] * cm["gate"][:, :, l][ok], ref["w", l][ok], f"context gated read {l}")
        w, j = np.nonzero(ok)
        rows += [dict(layer=l, head=(3 * k + l) % H, position=int(j[k]), shard=0, window=int(w[k]))
                 for k in np.linspace(0, len(w) - 1, 4).astype(int)]
    rows = pd.DataFrame(rows)
    rr = ContextRerun(ad, kernel, rows, toks[rows["window"].to_numpy()], 3, 5)
    deltas = {}
    rr.decode = lambda sel, delta, jlens: deltas.update(zip(sel.tolist(), delta.clone()))
    rr.run(8)
    for n, r in rows.iterrows():
        w, j, l, h = int(r["window"]), int(r["position"]), int(r["layer"]), int(r["head"])
        zhat = torch.as_tensor(cm["zhat"][w, j, l, h]).double()
        want = (ref["w", l][w, j, h] - zhat * ref["g", l][w, j, h]) @ _O(ad, l)[h]
        _close(deltas[n], want, f"context lens row {n}")
        _far((torch.as_tensor(cm["z"][w, j, l, h]).double() - zhat) @ _O(ad, l)[h], want, f"context lens row {n}")
    dev = mfpipe.context_deviation(model, ds, toks, reads="resid")
    for l in ad.attention_layers:
        ok = cm["valid"][:, :, l]
        want = torch.einsum("nhe,hed->nhd", ref["w", l][ok], _O(ad, l))
        _close(dev["z"].values[:, :, l][ok], want, f"notebook z {l}")
        _far(torch.einsum("nhe,hed->nhd", torch.as_tensor(cm["z"][:, :, l][ok]).double(), _O(ad, l)), want,
             f"notebook z {l}")


def test_statistics_map_a_query_types_read_through_its_centroids_gate(qwen, qwen_stats):
    from mfpipe.stats.api import MeanFieldStats

    model, ad = qwen
    st = MeanFieldStats(qwen_stats[1])
    for l in ad.attention_layers:
        block = model.model.layers[l]
        c = torch.as_tensor(st.centroids(depth=l).transpose("query", "dim").values, dtype=torch.float32)
        with torch.no_grad():  # the gate of each type's centroid, by hand: the norm, q_proj's second halves, sigmoid
            q = block.self_attn.q_proj(block.input_layernorm(c))
        g = torch.sigmoid(q.view(-1, H, 2 * DH)[..., DH:]).double()  # [query, H, dh]
        for name in ("zhat", "zbar"):
            z = torch.as_tensor(getattr(st, name)(layer=l).transpose("query", "head", "head_dim").values).double()
            if hasattr(block.self_attn, "attn_sub_norm"):  # BitNet: the factor of these reads, every head's
                g = _sub_norm(block.self_attn.attn_sub_norm, z)
            want = torch.einsum("qhe,hed->hqd", z * g, _O(ad, l))
            for given in (ad, ad.out_proj_slices):
                got = getattr(st, name)(layer=l, out_proj_slices=given).transpose("head", "query", "dim").values
                _close(np.nan_to_num(got), want.nan_to_num(), f"{name} {l}")
            _far(torch.einsum("qhe,hed->hqd", z, _O(ad, l)).nan_to_num(), want.nan_to_num(), f"{name} {l}")
    with pytest.raises(ValueError, match="gates each head's read"):
        st.mu(layer=1, out_proj_slices=ad)


def _D(z, zhat, O):
    """1 − cos of two head-space vectors' writes ``x @ O`` (O [dh, d]), over the last axis, float64."""
    zr, hr = z.double() @ O, zhat.double() @ O
    return 1 - (zr * hr).sum(-1) / ((zr * zr).sum(-1) * (hr * hr).sum(-1)).sqrt()


def test_the_deviation_meters_are_those_of_the_gated_writes(qwen, qwen_stats):
    """D = 1 − cos of the head's write and the mean field's write at the query, both through its own gate: pass 2's
    sums, the per-context meters, the prompt classes' deviation forward, the context lens's recomputed D and the
    substitution's head deviation all equal it from the hooks."""
    from mfpipe.deviation.contexts import context_meters
    from mfpipe.deviation.shards import deviation_shard
    from mfpipe.experiments.prompts.rerun import ContextRerun
    from mfpipe.experiments.substitution.substitute import substitution_batch
    from mfpipe.meanfield.forward import deviation_forward
    from mfpipe.notebook.meanfield import MeanField
    from mfpipe.stats.api import MeanFieldStats

    model, ad = qwen
    tokens, ds = qwen_stats
    toks = tokens[:3]
    st = MeanFieldStats(ds)
    kernel = MeanField(st).kernel(int(model.config.vocab_size)).to(ad.device)
    cm = context_meters(ad, kernel, toks, reads=True)
    ref = _hooked(model, toks)
    kb, qt = kernel.buckets(toks)
    fwd, _, _ = deviation_forward(ad, kernel, torch.as_tensor(toks.astype(np.int64)), kb, qt)
    sums, _ = deviation_shard(model, ad, toks, np.zeros((len(toks), 1), np.int64), tracked_for(tokens), st,
                              min_count=int(kernel.attrs.get("min_count", 1)), batch_size=2, progress=False)
    rows = []
    for l in ad.attention_layers:
        ok = cm["valid"][:, :, l]
        O = _O(ad, l)
        zhat = torch.as_tensor(cm["zhat"][:, :, l][ok]).double()  # [n, H, dh], the mean field (head space)
        want = torch.stack([_D(ref["w", l][ok][:, h], zhat[:, h] * ref["g", l][ok][:, h], O[h]) for h in range(H)], -1)
        _close(cm["D"][:, :, l][ok], want, f"context D {l}")
        _close(fwd["D"][:, :, l][torch.as_tensor(ok)], want, f"deviation_forward D {l}")
        _close(sums["D_sum"][:, l].sum(axis=(0, 2)), want.sum(0), f"pass 2 D sum {l}")
        z = torch.as_tensor(cm["z"][:, :, l][ok]).double()
        _far(torch.stack([_D(z[:, h], zhat[:, h], O[h]) for h in range(H)], -1), want, f"context D {l}")
        w, j = np.nonzero(ok)
        rows += [dict(layer=l, head=k % H, position=int(j[k]), shard=0, window=int(w[k]), D=float(want[k, k % H]))
                 for k in range(0, len(w), max(1, len(w) // 4))]
    rows = pd.DataFrame(rows)
    rr = ContextRerun(ad, kernel, rows, toks[rows["window"].to_numpy()], 3, 5)
    rr.run(8)
    _close(rr.out["D_recomputed"], rows["D"].to_numpy(), "context lens D")
    # the substitution's head deviation: Σ over substituted positions of D with its own ẑ, through the gate
    from mfpipe.meanfield.kernel import kernel_from_store

    k1 = kernel_from_store(st, tracked_for(tokens), min_count=1).to(ad.device)  # every seen pair: many substituted
    sums_sub, _ = substitution_batch(ad, k1, toks)
    zh, sub = k1.zhat(*k1.buckets(toks))
    assert int(sub.sum()) > 5, int(sub.sum())
    for l in ad.attention_layers:
        w, g = ref["w", l][sub], ref["g", l][sub]
        want = torch.stack([_D(w[:, h], zh[l][sub][:, h].double() * g[:, h], _O(ad, l)[h]) for h in range(H)], -1)
        _close(sums_sub.head_deviation[l], want.sum(0), f"substitution head deviation {l}")


def test_the_positional_deviation_is_the_gated_write_and_nan_without_heads(qwen, qwen_stats):
    """App. positional's Δ (mfpipe.experiments.positional.collect): the head's write less the mean field's, both
    through the query's own gate, Δ = g ⊙ (z − z̄_s), so Δ O_h is a write the model makes (before stop 81 the reads
    with the gate divided out: a vector no head adds). At a hybrid's layers without attention every field is NaN and
    the head table keeps no occurrence there (it was uninitialised memory: arbitrary counts and posVar fits)."""
    from mfpipe.experiments.positional import analysis as An
    from mfpipe.experiments.positional import collect as C
    from mfpipe.notebook.meanfield import MeanField
    from mfpipe.stats.api import MeanFieldStats

    model, ad = qwen
    tokens, ds = qwen_stats
    st = MeanFieldStats(ds)
    kernel = MeanField(st).kernel(int(model.config.vocab_size)).to(ad.device)
    zbar = torch.from_numpy(np.asarray(st.zbar().transpose("query", "layer", "head", "head_dim").values, np.float32))
    ev = tokens[:3].astype(np.int64)
    w, p = C.sample_occurrences(len(ev), ev.shape[1], stride=1, min_position=1, budget=10**6, seed=0)
    occ = C.collect(ad, kernel, zbar, ev, None, w, p, batch_size=2)
    ref = _hooked(model, ev)
    for l in range(ad.n_layers):
        d = torch.as_tensor(occ.delta[:, l]).double()
        if l not in ad.attention_layers:
            assert d.isnan().all() and np.isnan(occ.other[:, l]).all()
            continue
        z = ref["w", l][occ.window, occ.position]  # the gated read, g ⊙ z
        g = ref["g", l][occ.window, occ.position]
        want = z - g * zbar[occ.query_type, l].double()
        _close(d, want, f"positional Δ {l}")
        _far(d / g, want, f"positional Δ {l}")
    O = np.stack([ad.out_proj_slices(l).double().numpy() for l in range(ad.n_layers)])
    S_bar = np.arange(ad.n_layers * H, dtype=float).reshape(ad.n_layers, H)
    heads = An.head_table(occ, O, None, S_bar, ev.shape[1], dict(min_position=1, max_other=1.0))
    gone = heads[~heads["layer"].isin(list(ad.attention_layers))]
    assert (gone["n"] == 0).all() and (heads.loc[heads["layer"].isin(list(ad.attention_layers)), "n"] > 0).all()
