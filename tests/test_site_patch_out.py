"""The read/patch site's ``patch_out`` (``Adapter.run``): replacing the attention output projection's output, the
positional-transport ablation's patch point (a residual-space subspace projected out of some heads' summed write),
against a plain torch forward hook on the output projection doing the same computation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model, random_ids

from mfpipe.experiments.positional.ablation import project_out_heads
from mfpipe.models.adapters import get_adapter

B, T = 2, 12
HEADS = {(0, 1), (1, 0)}  # (layer, head) whose summed write loses the subspace
RANK = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2"])  # plain, rotary, post-attention norm
def tiny(request):
    model = make_tiny_model(request.param, seed=5)
    ad = get_adapter(model)
    assert ad.n_layers == 2
    ids = random_ids(B, T, seed=6, bos=1)
    plain = ad.run(ids, select=(), logits=True).logits
    return model, ad, ids, plain


def test_project_out_heads_is_the_direct_formula():
    """mfpipe.experiments.positional.ablation.project_out_heads (what the site patches with below) against the
    per-head loop: ``out − (Σ_h z_h O_h) S Sᵀ``; the heads' write then has no component in S."""
    g = torch.Generator().manual_seed(3)
    out, reads, O = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 4, 3, generator=g), torch.randn(4, 3, 16,
                                                                                                      generator=g)
    S = _basis(16, 2, seed=4)
    write = sum(reads[..., h, :] @ O[h] for h in (0, 2))
    got = project_out_heads(out, reads, O, [0, 2], S)
    assert torch.allclose(got, out - (write @ S) @ S.T, atol=1e-6)
    assert ((got - out + write) @ S).abs().max() < 1e-5  # the heads' write minus its S part: no S component left
    assert torch.equal(project_out_heads(out, reads, O, [0, 2], S[:, :0]), out)


def _heads_of(layer):
    return sorted(h for (lay, h) in HEADS if lay == layer)


def _basis(d, k, seed=0):
    q, _ = torch.linalg.qr(torch.randn(d, max(k, 1), generator=torch.Generator().manual_seed(seed)))
    return q[:, :k].contiguous()


def _site_patch(ad, basis):
    slices = [ad.out_proj_slices(layer).float() for layer in range(ad.n_layers)]

    def patch_out(layer, out, reads):
        assert out.dtype == torch.float32 and out.shape == (B, T, ad.d_model)
        assert reads.dtype == torch.float32 and reads.shape == (B, T, ad.n_heads, ad.d_head)
        return project_out_heads(out, reads, slices[layer], _heads_of(layer), basis)

    return patch_out


def _hook_reference(model, ad, ids, basis):
    """The same projection by plain torch forward hooks on each layer's output projection (from its own input)."""
    slices = [ad.out_proj_slices(layer).float() for layer in range(ad.n_layers)]

    def hook_for(layer):
        def hook(mod, args, output):
            x = args[0]
            reads = x.reshape(*x.shape[:2], ad.n_heads, ad.d_head).float()
            return project_out_heads(output.float(), reads, slices[layer], _heads_of(layer), basis).to(output.dtype)

        return hook

    handles = [ad.out_proj_module(layer).register_forward_hook(hook_for(layer)) for layer in range(ad.n_layers)]
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()


def test_patch_out_identity_or_none_is_bit_identical(tiny):
    _, ad, ids, plain = tiny
    seen = []

    def same(layer, out, reads):
        seen.append(layer)
        return out

    got = ad.run(ids, select=(), patch_out=same, logits=True).logits
    assert seen == list(range(ad.n_layers))  # once per layer, in layer order
    assert torch.equal(got, plain)
    got = ad.run(ids, select=(), patch_out=lambda layer, out, reads: None, logits=True).logits
    assert torch.equal(got, plain)


def test_patch_out_projects_heads_subspace_like_torch_hook(tiny):
    """Acceptance: a rank-3 subspace projected out of heads {(0,1),(1,0)}'s summed write, in both layers, through the
    site == a plain forward hook on the output projection; `reads` stays unpatched, `attn_out` follows the patch."""
    model, ad, ids, plain = tiny
    basis = _basis(ad.d_model, RANK, seed=7)
    caps, outs = [], []
    patch = _site_patch(ad, basis)

    def patch_out(layer, out, reads):
        new = patch(layer, out, reads)
        outs.append((out.clone(), new.clone()))
        return new

    got = ad.run(ids, select=("reads", "attn_out"), on_layer=caps.append, patch_out=patch_out, logits=True).logits
    want = _hook_reference(model, ad, ids, basis)
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - plain).abs().max().item() > 1e-4  # the patch is not ignored
    for layer, (cap, (out, new)) in enumerate(zip(caps, outs, strict=True)):
        assert (out - new).abs().max().item() > 1e-6  # each layer's patch moved its own output
        # reads: what attention computed, which reproduces the unpatched projection output
        rebuilt = torch.einsum("bthk,hkd->btd", cap.reads, ad.out_proj_slices(layer).float())
        bias = ad.out_proj_bias(layer)
        rebuilt = rebuilt + (0 if bias is None else bias.float())
        assert (rebuilt - out).abs().max().item() <= 1e-5
        assert (cap.attn_out - ad.post_attn_norm(layer, new)).abs().max().item() <= 1e-5


def test_patch_out_sees_reads_after_patch_reads(tiny):
    """The reads handed to patch_out are the ones that went into the projection (after patch_reads)."""
    _, ad, ids, _ = tiny
    checked = []

    def zero_head(layer, reads):
        new = reads.clone()
        new[..., 2, :] = 0
        return new

    def patch_out(layer, out, reads):
        assert torch.all(reads[..., 2, :] == 0)
        rebuilt = torch.einsum("bthk,hkd->btd", reads, ad.out_proj_slices(layer).float())
        bias = ad.out_proj_bias(layer)
        rebuilt = rebuilt + (0 if bias is None else bias.float())
        assert (rebuilt - out).abs().max().item() <= 1e-5
        checked.append(layer)

    ad.run(ids, select=(), patch_reads=zero_head, patch_out=patch_out)
    assert checked == list(range(ad.n_layers))


def test_patch_out_empty_basis_and_bad_shape(tiny):
    _, ad, ids, plain = tiny
    got = ad.run(ids, select=(), patch_out=_site_patch(ad, _basis(ad.d_model, 0)), logits=True).logits
    assert torch.equal(got, plain)
    with pytest.raises(ValueError, match=r"patch_out\(layer=0\).*\[B,T,d\]"):
        ad.run(ids, select=(), patch_out=lambda layer, out, reads: out[:, :-1], logits=True)
    with pytest.raises(ValueError, match=r"patch_out\(layer=0\) returned list"):
        ad.run(ids, select=(), patch_out=lambda layer, out, reads: out.tolist())
