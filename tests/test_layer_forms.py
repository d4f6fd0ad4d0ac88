"""Per-layer attention forms (issue 59 §0, mfpipe.models.adapters.layers): a model whose layers differ in head width
and KV heads is read with every head-space tensor zero-padded to the widest layer's width, an exact embedding.

The padded model is a tiny Llama whose layer 1 is rebuilt with values and reads 8 wider per head and twice the KV
heads (the new value coordinates' weights 0, each KV head copied to both query heads that read it): it computes what
the plain Llama computes. Read with a hand-made ``layer_forms``, its statistics, pass 2's meters, the substitution's
logits and the rollout equal the plain model's, and every padded coordinate is exactly 0; the placement by kind finds
the same forms by itself."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from stats_reference import finite_scale, tracked_for, zipf_windows
from tiny_models import make_tiny_model
from transformers.models.llama import modeling_llama as ML

from mfpipe.conformance import check_model
from mfpipe.deviation import shards as DP
from mfpipe.experiments.rollout import algorithm as R
from mfpipe.meanfield.kernel import kernel_from_store
from mfpipe.models.adapters import Adapter, describe, get_adapter
from mfpipe.models.adapters.layers import LayerForm
from mfpipe.stats import MeanFieldStats, accumulate_shard, finalize, open_stats, write_store

H, KV, DH, D, EXTRA, WIDE = 4, 2, 16, 64, 8, 1  # the tiny Llama's sizes; layer WIDE is EXTRA wider per head


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


class LlamaAttention(ML.LlamaAttention):  # Llama's name: one attention class in every block, as the placement asks
    """Llama's attention whose values and reads are ``v_head_dim`` wide (its queries and keys ``head_dim``)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(*shape, -1, self.v_head_dim).transpose(1, 2)
        q, k = ML.apply_rotary_pos_emb(q, k, *position_embeddings)
        out, weights = ML.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights


def linear(weight: torch.Tensor) -> torch.nn.Linear:
    m = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    m.weight.data.copy_(weight)
    return m


def widened(model):
    """``model`` (a tiny Llama) with layer WIDE's heads EXTRA wider and one KV head per query head: the same function."""
    wide = copy.deepcopy(model)
    old = wide.model.layers[WIDE].self_attn
    new = LlamaAttention(wide.config, WIDE).eval()
    new.v_head_dim, new.num_key_value_groups = DH + EXTRA, 1
    kv_of = torch.arange(H) // (H // KV)  # query head h reads KV head h // (H / KV), as repeat_kv does
    with torch.no_grad():
        v = torch.zeros(H, DH + EXTRA, D)
        v[:, :DH] = old.v_proj.weight.view(KV, DH, D)[kv_of]
        o = torch.zeros(D, H, DH + EXTRA)
        o[..., :DH] = old.o_proj.weight.view(D, H, DH)
        new.q_proj = old.q_proj
        new.k_proj = linear(old.k_proj.weight.view(KV, DH, D)[kv_of].reshape(H * DH, D))
        new.v_proj, new.o_proj = linear(v.reshape(-1, D)), linear(o.reshape(D, -1))
    wide.model.layers[WIDE].self_attn = new
    return wide


FORMS = tuple(LayerForm(DH + EXTRA, H, "self_attn.v_proj") if l == WIDE else LayerForm(DH, KV, "self_attn.v_proj")
              for l in range(2))


@pytest.fixture(scope="module")
def pair():
    plain = make_tiny_model("llama", seed=3)
    wide = widened(plain)
    padded = Adapter(wide, dataclasses.replace(describe(plain), layer_forms=FORMS))  # the forms by hand
    return plain, get_adapter(plain), wide, padded


def same_padded(name, got, want, pad_axes=(), rtol=1e-5):
    """``got`` is ``want`` zero-padded along each of ``pad_axes`` (head-space axes): its first coordinates close, the
    rest exactly 0."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    for axis in (pad_axes,) if isinstance(pad_axes, int) else pad_axes:
        n = want.shape[axis]
        assert got.shape[axis] == n + EXTRA, name
        rest = np.take(got, np.arange(n, n + EXTRA), axis=axis)
        assert np.all(rest[~np.isnan(rest)] == 0), f"{name}: a padded coordinate is not 0"
        got = np.take(got, np.arange(n), axis=axis)
    assert got.shape == want.shape, f"{name}: {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * finite_scale(want, 1e-12), equal_nan=True,
                               err_msg=name)


def same_dataset(got, want, what):
    for name, var in want.data_vars.items():
        axes = [i for i, d in enumerate(var.dims) if d.startswith("head_dim")]  # pass 2's gram has two
        same_padded(f"{what}: {name}", got[name].values, var.values, axes)


def test_the_widened_model_computes_what_the_plain_one_does(pair):
    plain, _, wide, padded = pair
    ids = torch.as_tensor(zipf_windows(2, seed=4).astype(np.int64))
    with torch.no_grad():
        np.testing.assert_allclose(wide(ids).logits.numpy(), plain(ids).logits.numpy(), rtol=1e-5, atol=1e-5)
    assert padded.d_head == DH + EXTRA and padded.n_kv_heads == H
    assert [padded.head_dim(l) for l in range(2)] == [DH, DH + EXTRA] and padded.kv_heads(0) == KV


def test_the_placement_finds_the_forms_by_kind(pair):
    plain, _, wide, _ = pair
    assert describe(plain).layer_forms == ()  # one kind: untouched
    assert describe(wide).layer_forms == FORMS


def test_the_site_and_the_block_pieces_are_the_plain_ones_padded(pair):
    plain, ad, wide, padded = pair
    ids = zipf_windows(2, seed=4)
    want, got = [], []
    ad.capture(ids, want.append)
    padded.capture(ids, got.append)
    for a, b in zip(want, got):
        for f in ("values", "reads"):  # [B,H,T,dh], [B,T,H,dh]
            same_padded(f"layer {a.layer} {f}", getattr(b, f), getattr(a, f), -1)
        for f in ("attn_probs", "resid_in", "attn_out", "mlp_out"):
            same_padded(f"layer {a.layer} {f}", getattr(b, f), getattr(a, f))
        x = a.resid_in[0]
        same_padded("value_map", padded.value_map(a.layer, x), ad.value_map(a.layer, x), -1)
        same_padded("out_proj_slices", padded.out_proj_slices(a.layer), ad.out_proj_slices(a.layer), 1)
        w, b = padded.value_weights(a.layer)
        same_padded("value_weights", w, ad.value_weights(a.layer)[0], -1)
        assert b is None


def test_statistics_pass2_substitution_and_rollout_equal_the_plain_run(pair, tmp_path):
    plain, ad, wide, padded = pair
    tokens = zipf_windows(8, seed=1)
    tracked = tracked_for(tokens)
    runs = {}
    for name, model, adapter in (("plain", plain, ad), ("padded", wide, padded)):
        sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=4, device="cpu", progress=False)
        ds = finalize(sums, tracked, {"model": name, "half": "stats"}, dtype=np.float64)
        st = MeanFieldStats(ds)
        p2, meta = DP.deviation_shard(model, adapter, tokens, np.zeros_like(tokens), tracked, st, min_count=1,
                                      batch_size=4, progress=False)
        kernel = kernel_from_store(open_stats(write_store(finalize(sums, tracked, {"model": name, "half": "stats"}),
                                                          tmp_path / f"{name}.zarr")), tracked, min_count=1)
        kb, qt = kernel.buckets(tokens)
        zhat, sub = kernel.zhat(kb, qt)
        logits = adapter.run(tokens, patch_reads=lambda l, r, z=zhat, s=sub: torch.where(
            s[..., None, None], z[l].to(r.dtype), r), logits=True).logits
        b = R.bos_residuals(adapter, tracked.bos_id)
        P = np.random.default_rng(2).dirichlet(np.ones(tracked.n + 2) * 0.7, size=(2, H, tracked.n))
        roll = R.rollout(adapter, P, b, type_ids=tracked.type_ids, context_length=tokens.shape[1])
        runs[name] = (ds, DP.deviation_dataset(p2, meta, tracked, min_occurrences=2), logits, int(sub.sum()), roll)
    (ds0, dev0, lg0, n0, roll0), (ds1, dev1, lg1, n1, roll1) = runs["plain"], runs["padded"]
    same_dataset(ds1, ds0, "statistics")
    same_dataset(dev1, dev0, "pass 2")
    assert n0 == n1 > 10
    same_padded("substitution logits", lg1, lg0)
    same_padded("rollout", roll1, roll0)


def test_a_replacement_with_nonzero_padding_is_refused(pair):
    _, _, _, padded = pair
    ids = zipf_windows(1, seed=4)
    with pytest.raises(ValueError, match="padded coordinates 16..23"):
        padded.run(ids, patch_reads=lambda l, r: r + 1.0 if l == 0 else None)


def test_the_padded_model_passes_every_conformance_check(pair):
    _, _, wide, padded = pair
    rows = check_model(wide, padded.structure)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_mimo_places_its_value_scale_and_its_sliding_window_layers_kv_heads():
    """MiMo-V2-Flash: values times v_scale (the config's attention_value_scale), a full-attention layer of 2 KV heads
    and a sliding-window one of 4 (with sinks); without the scale the same forms, value_scale 1."""
    s = describe(make_tiny_model("mimo_v2_flash", seed=2))
    assert s.value_scale == 0.6 and s.value_head_dim == 16
    assert [(f.head_dim, f.kv_heads) for f in s.layer_forms] == [(16, 2), (16, 4)]
    plain = describe(make_tiny_model("mimo_v2_flash", seed=2, attention_value_scale=None))
    assert plain.value_scale == 1.0 and plain.layer_forms == s.layer_forms


def test_a_value_scale_the_forward_does_not_apply_is_refused():
    """The scale is read off the attention's v_scale and confirmed by the value search: a Llama's attention given a
    v_scale it never multiplies by is not placed with it."""
    model = make_tiny_model("llama", seed=2)
    for layer in model.model.layers:
        layer.self_attn.v_scale = 0.5
    with pytest.raises(Exception, match="cannot place the value projection"):
        describe(model)


def test_forms_the_adapter_cannot_read_are_refused(pair):
    plain, _, wide, _ = pair
    s = describe(plain)
    with pytest.raises(ValueError, match="one per layer"):
        Adapter(wide, dataclasses.replace(s, layer_forms=FORMS[:1]))
    with pytest.raises(ValueError, match="not a multiple of the KV heads"):
        Adapter(wide, dataclasses.replace(s, layer_forms=(FORMS[0], LayerForm(DH + EXTRA, 3, "self_attn.v_proj"))))
