"""Issue 59 item 3: block forms beyond one attention module and one MLP (mfpipe.models.adapters.forms), on tiny random
copies of the families' default configs (the census's shrinker), vocabulary set to the statistics tests':

* Nemotron-H: blocks of one mixer each -- Mamba, attention without an MLP, an MLP or a mixture of experts without
  attention (a layer kind of its own, "mlp");
* Falcon-H1: attention and a Mamba mixer side by side in every block, their outputs summed, then the MLP;
* Mllama on text: its cross-attention layers, which the model's forward skips, carried as the identity;
* DBRX: the attention and its two norms inside one module of the block (``norm_attn_norm``), its queries, keys and
  values clamped to +-clip_qkv (set small here, so that most are).

For each, the statistics equal per-position loops over the model's own forward read by plain torch hooks on modules
named here by hand (NaN rows and the layer's kind at the layers that are not attention), writing the model's own
reads back leaves the logits bit-identical, the mean-field write-back equals a torch pre-hook on the attention
layers' output projections, and the rollout's block update at a one-token sequence (each head reads its own value) is
the model's own block on that sequence: Falcon-H1's Mamba branch included, Nemotron-H's missing MLP zero, Mllama's
skipped layer the identity, DBRX's values clamped. Each family passes every conformance check of the census (on
its default config). Zamba's shared block, LongCat-Flash's two attention sublayers per block and HRM's recurrent
stacks are refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layer_loops import loop_means, mean_field_patch
from stats_reference import BOS, VOCAB, finite_scale, tracked_for, zipf_windows

from mfpipe.models.adapters import describe, get_adapter
from mfpipe.models.adapters.probe import submodule

# per family: the config class, the attention module and the MLP module in an attention block (None: it has none),
# the attention's value source and output projection
SPECS = {
    "nemotron_h": ("NemotronHConfig", "mixer", None, "v_proj", "o_proj"),
    "falcon_h1": ("FalconH1Config", "self_attn", "feed_forward", "v_proj", "o_proj"),
    # its released checkpoints' muP multipliers not 1 (MUP below): the attention reads its norm times one number and
    # its output joins times another, the Mamba's times a third (before stop 81: refused for the first two)
    "falcon_h1_mup": ("FalconH1Config", "self_attn", "feed_forward", "v_proj", "o_proj"),
    "mllama": ("MllamaConfig", "self_attn", "mlp", "v_proj", "o_proj"),  # a composite: its text-only causal LM
    "dbrx": ("DbrxConfig", "norm_attn_norm.attn", "ffn", "Wqkv", "out_proj"),  # [q | k | v], clamped to +-clip_qkv
}
MUP = dict(attention_in_multiplier=1.7, attention_out_multiplier=0.6, ssm_out_multiplier=0.23, ssm_in_multiplier=1.25,
           embedding_multiplier=5.66, lm_head_multiplier=0.04, key_multiplier=0.39, mlp_multipliers=[0.88, 0.59])
CLIP = 0.05  # the tiny DBRX's clip_qkv: most of its projections' outputs are clamped (the default 8 clamps none)


def _values(name: str, out: torch.Tensor, ad) -> torch.Tensor:
    """The values [B,T,KV*dh] from the value source's output, as written by hand for each family."""
    if name != "dbrx":
        return out
    kv = ad.n_kv_heads * ad.d_head
    return out.clamp(-CLIP, CLIP)[..., ad.d_model + kv: ad.d_model + 2 * kv]


def tiny(family: str, seed: int = 3):
    import transformers

    from mfpipe.models.adapters.composite import is_composite, language_model, shrink_composite, text_config
    from mfpipe.models.tiny import random_model, shrink_config

    cfg = getattr(transformers, SPECS[family][0])(**(MUP if family == "falcon_h1_mup" else {}))
    cfg = shrink_composite(cfg, shrink_config) if is_composite(cfg) else shrink_config(cfg)
    tcfg = text_config(cfg)
    tcfg.vocab_size, tcfg.bos_token_id, tcfg.eos_token_id, tcfg.pad_token_id = VOCAB, BOS, None, None
    if hasattr(tcfg, "use_mamba_kernels"):
        tcfg.use_mamba_kernels = False
    if family == "dbrx":
        tcfg.attn_config.clip_qkv = CLIP
    return language_model(random_model(cfg, seed=seed))


@pytest.fixture(scope="module", params=sorted(SPECS))
def family(request):
    model = tiny(request.param)
    return request.param, model, get_adapter(model)


def _blocks(model):
    return model.transformer.blocks if hasattr(model, "transformer") else model.model.layers


def _hooked_forward(model, ad, name: str, ids):
    """The model's own forward with plain torch hooks on modules named by hand: per attention layer the
    probabilities, values [B,T,H,dh], reads, attention output and MLP output (zero where the block has none), None at
    the others; and the residual entering each block (a block the forward skips: the one entering the next block run,
    which is what the skip leaves it), float64."""
    attn, mlp, vsrc, oproj = SPECS[name][1:]
    got: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for l, block in enumerate(_blocks(model)):
        handles.append(block.register_forward_pre_hook(
            lambda m, a, k, l=l: got.__setitem__(("x", l), a[0] if a else k["hidden_states"]), with_kwargs=True))
        if ad.layer_kinds[l] != "attention":
            continue
        a = submodule(block, attn)
        handles += [
            getattr(a, vsrc).register_forward_hook(lambda m, i, o, l=l: got.__setitem__(("v", l), o)),
            getattr(a, oproj).register_forward_pre_hook(lambda m, i, l=l: got.__setitem__(("z", l), i[0])),
            a.register_forward_hook(lambda m, i, o, l=l: got.update({("a", l): o[0], ("p", l): o[1]}) and None),
        ]
        if mlp is not None:
            handles.append(getattr(block, mlp).register_forward_hook(
                lambda m, i, o, l=l: got.__setitem__(("m", l), o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    L, (B, T) = len(_blocks(model)), ids.shape
    H, KV, dh = ad.n_heads, ad.n_kv_heads, ad.d_head
    hidden = [None] * L
    for l in reversed(range(L)):  # a skipped block's input is the next run block's
        hidden[l] = got[("x", l)].double() if ("x", l) in got else hidden[l + 1]
    per = []
    for l in range(L):
        if ("v", l) not in got:
            per.append(None)
            continue
        v = _values(name, got[("v", l)], ad).reshape(B, T, KV, dh).repeat_interleave(H // KV, dim=2)
        a = got[("a", l)].double() * getattr(_blocks(model)[l], "attn_out_multiplier", 1.0)  # as the block joins it
        per.append(dict(probs=got[("p", l)].double(), values=v.double(), reads=got[("z", l)].view(B, T, H, dh).double(),
                        attn_out=a, mlp_out=got[("m", l)].double() if mlp else torch.zeros_like(a)))
    return per, hidden


def _loops(model, ad, name, tokens, tracked):
    """Per-position loops (tests/layer_loops.py) over the hooked forward; NaN at the layers that are not attention."""
    per, hidden = _hooked_forward(model, ad, name, torch.as_tensor(tokens.astype(np.int64)))
    return loop_means(per, hidden, tokens, tracked, ad.n_layers, ad.n_heads, ad.d_head, ad.d_model)


def test_each_form_is_placed_as_it_is(family):
    name, model, ad = family
    s = describe(model)
    kinds = set(ad.layer_kinds)
    if name == "nemotron_h":  # one mixer per block: the attention blocks have no MLP, the MLP blocks no attention
        assert s.mlp is None and {"attention", "mamba", "mlp"} <= kinds
        assert float(ad.mlp(ad.attention_layers[0], torch.randn(3, ad.d_model)).abs().max()) == 0.0
    if name.startswith("falcon_h1"):  # every block attention, with its Mamba beside it
        assert kinds == {"attention"} and s.side_mixer == "mamba" and s.mlp == "feed_forward"
        want = (MUP["attention_in_multiplier"], MUP["attention_out_multiplier"]) if name == "falcon_h1_mup" else (1, 1)
        assert s.attn_scales == want and s.side_scale == (MUP["ssm_out_multiplier"] if name.endswith("mup") else 1)
        assert s.embed_scale == (MUP["embedding_multiplier"] if name.endswith("mup") else 1)
        if name.endswith("mup"):  # (the plain one: the census's, below)
            from mfpipe.conformance import check_model

            rows = check_model(model, s, seed=0)
            assert len(rows) >= 15 and all(r.ok for r in rows), [r.name for r in rows if not r.ok]
        assert not ad.mlp_out_from_resid  # the residual gains three branches: mlp_out is read, never derived
    if name == "dbrx":  # the attention and its norms in one module; q, k, v clamped (most of them, here)
        assert (s.attn, s.attn_norm, s.mlp_norm, s.mlp) == ("norm_attn_norm.attn", "norm_attn_norm.norm_1",
                                                           "norm_attn_norm.norm_2", "ffn")
        assert s.value_clip == CLIP and ad.value_weights(0) is None  # not affine: the values are summed as read
    if name == "mllama":  # the cross-attention layers, skipped on text, are a kind of their own
        assert kinds == {"attention", "cross_attention"} and s.side_mixer is None
        assert [k == "cross_attention" for k in ad.layer_kinds] == [
            l in model.config.cross_attention_layers for l in range(ad.n_layers)]
        assert ad.layer_kinds[-1] == "attention"  # as the full depth: the last block runs (the shrinker keeps it so)


def test_statistics_equal_the_per_position_loops(family):
    from mfpipe.stats import accumulate_shard, finalize

    name, model, ad = family
    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(model, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    ds = finalize(sums, tracked, {"model": f"tiny-{name}", "layer_kinds": list(ad.layer_kinds)}, dtype=np.float64)
    ref = _loops(model, ad, name, tokens, tracked)
    L = ad.n_layers
    assert list(ds["layer_kind"].values) == list(ad.layer_kinds)
    for stat, want in (("P", ref["P"]), ("mu", ref["mu"]), ("zbar", ref["zbar"]), ("attn_out_mean", ref["attn_out"]),
                       ("mlp_out_mean", ref["mlp_out"]), ("centroid", ref["centroid"])):
        got = np.asarray(ds[stat].values, dtype=np.float64)[:L]
        assert np.array_equal(np.isnan(got), np.isnan(want)), stat
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * finite_scale(want, 1e-3), equal_nan=True,
                                   err_msg=f"{name}: {stat}")
    A = list(ad.attention_layers)
    np.testing.assert_allclose(ds["P"].values[A].sum(-1), 1.0, atol=1e-5)
    assert np.isfinite(ds["centroid"].values[:, :tracked.n]).all()  # the residual entering every block is measured


def test_substitution_equals_a_torch_hook_on_the_attention_layers(family, tmp_path):
    name, model, ad = family
    attn, oproj = SPECS[name][1], SPECS[name][4]
    tokens = zipf_windows(8, seed=1)
    tracked = tracked_for(tokens)
    ids = torch.as_tensor(tokens.astype(np.int64))
    seen = []

    def own(layer, reads):
        seen.append(layer)
        return reads

    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    got = ad.run(ids, patch_reads=own, logits=True)
    assert sorted(set(seen)) == list(ad.attention_layers)  # patch_reads is called at the attention layers only
    assert torch.equal(got.logits, want)  # own reads written back: the logits bit-identical
    zhat, sub, replace = mean_field_patch(model, ad, tokens, tracked, name, tmp_path)
    assert int(sub.sum()) > 10

    got = ad.run(ids, patch_reads=replace, logits=True).logits
    H, dh = ad.n_heads, ad.d_head
    handles = [getattr(submodule(_blocks(model)[l], attn), oproj).register_forward_pre_hook(
        lambda m, a, l=l: (replace(l, a[0].view(*a[0].shape[:2], H, dh)).reshape(a[0].shape),))
        for l in ad.attention_layers]
    try:
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    assert float((got - ref).abs().max()) <= 1e-5 and float((got - want).abs().max()) > 1e-4


def test_the_rollouts_block_is_the_models_own_on_one_token(family):
    from mfpipe.experiments.rollout.algorithm import block_update, bos_residuals, rollout
    from mfpipe.models.adapters.hybrid import mixer_block

    name, model, ad = family
    types = torch.tensor([3, 5, 7])
    caps, finals = [], []
    ad.capture(types[:, None], caps.append, finals.append)  # each type as a sequence of one token
    L = ad.n_layers
    nxt = [c.resid_in[:, 0] for c in caps[1:]] + [finals[0][:, 0]]
    for l in range(L):
        c = caps[l].resid_in[:, 0]
        if l in ad.attention_layers:  # one token: each head reads its own value
            got = block_update(ad, l, c, ad.value_map(l, c))
        else:
            got = mixer_block(ad, l, c)
        assert float((got - nxt[l]).abs().max()) <= 1e-5 * max(1.0, float(nxt[l].abs().max())), (name, l)
    H, N = ad.n_heads, len(types)
    K = np.full((L, H, N, N + 2), np.nan)
    K[list(ad.attention_layers)] = 0.0
    K[list(ad.attention_layers), :, :, N] = 1.0  # every query reads the <bos> column only
    got = rollout(ad, K, bos_residuals(ad, BOS), type_ids=types.numpy())
    assert got.shape == (L + 1, N, ad.d_model) and np.isfinite(got).all()


@pytest.mark.parametrize("name", sorted(set(SPECS) - {"falcon_h1_mup"}))
def test_the_families_pass_every_conformance_check(name):
    from mfpipe.models.census import census_row

    row = census_row(name)
    assert row.accepted, row


# the families that cannot be read as heads writing a residual stream of blocks of their own: the refusal says why
REFUSED = {
    "zamba": "output enters the input of the layer's Mamba mixer, not the residual stream",
    "zamba2": "sits in Zamba2AttentionDecoderLayer, a block of its own",
    "longcat_flash": "holds 2 attention sublayers (a list, self_attn), which its num_hidden_layers (4) counts",
    "hrm_text": "blocks (L_module.layers, H_module.layers) 128 times, again in recurrent cycles",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_family_of_another_form_is_refused_saying_why(name):
    from mfpipe.models.census import census_row

    row = census_row(name)
    assert not row.placed and REFUSED[name] in row.reason, row


def test_the_mlp_input_mean_beside_a_mixer_includes_its_branch(family):
    """Falcon-H1's MLP reads the residual after the heads' and the Mamba's branches: App. K's MLP input mean is the
    next block's input less the MLP branch, not ``resid_mid`` (the heads' alone), as a hook on its norm reads it."""
    from mfpipe.experiments.rollout.diagnostics import mlp_input_means
    from mfpipe.stats import accumulate_shard, finalize

    name, model, ad = family
    if not name.startswith("falcon_h1"):
        pytest.skip("a mixer beside the attention: Falcon-H1's")
    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    ds = finalize(accumulate_shard(model, ad, tokens, tracked, batch_size=4, device="cpu", progress=False), tracked,
                  {"model": "tiny", "layer_kinds": list(ad.layer_kinds)}, dtype=np.float64)
    N, L = tracked.n, ad.n_layers
    mid = ds["resid_mid_mean"].values[:, :N]
    got = mlp_input_means(ad, ds["centroid"].values[:, :N], mid, ds["mlp_out_mean"].values[:, :N])
    seen = {}
    hooks = [b.pre_ff_layernorm.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(l, a[0].double()))
             for l, b in enumerate(_blocks(model))]
    try:
        with torch.no_grad():
            model(torch.as_tensor(tokens.astype(np.int64)), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}
    want, n = np.zeros((L, N, ad.d_model)), np.zeros(N)
    for w, j in np.ndindex(*tokens.shape):
        t = rank.get(int(tokens[w, j])) if j else None  # position 0 is <bos>
        if t is not None:
            n[t] += 1
            for l in range(L):
                want[l, t] += seen[l][w, j].numpy()
    ok = n > 0
    want = want[:, ok] / n[ok][None, :, None]
    assert np.abs(got[:, ok] - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(mid[:L, ok] - want).max() > 1e-3  # resid_mid misses the Mamba branch
