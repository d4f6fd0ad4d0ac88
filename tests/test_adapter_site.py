"""The adapters' read/patch site (``Adapter.run``) against the independent HF reference (tests/hf_reference.py):
patched head reads vs a plain torch forward_pre_hook doing the same patch, logits and loss vs HF's own forward,
and the field selector."""

from __future__ import annotations

import pytest
import torch
from hf_reference import patched_reads, reference_run
from tiny_models import TINY_MODEL_TYPES, make_tiny_model, random_ids

from mfpipe.models.adapters import CAPTURE_FIELDS, RunResult, get_adapter

B, T = 2, 16
LAYER, HEAD = 1, 2
POSITIONS = [3, 7, 8, 15]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=TINY_MODEL_TYPES)
def tiny(request):
    model = make_tiny_model(request.param, seed=2)
    ids = random_ids(B, T, seed=3, bos=1)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    return model, get_adapter(model), ids, plain


def one_head_patch(n_heads: int, d_head: int, seed: int = 0):
    """patch(layer, reads) replacing head HEAD's read at POSITIONS of layer LAYER by a fixed random vector."""
    repl = torch.randn(B, len(POSITIONS), d_head, generator=torch.Generator().manual_seed(seed))

    def patch(layer, reads):
        assert reads.shape == (B, T, n_heads, d_head)
        if layer != LAYER:
            return None
        new = reads.clone()
        new[:, POSITIONS, HEAD] = repl.to(new.dtype)
        return new

    return patch


def _maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_patched_logits_equal_torch_hook(tiny):
    """Acceptance (issue 9): one head's read patched through the adapter site == a plain forward_pre_hook."""
    model, ad, ids, plain = tiny
    patch = one_head_patch(ad.n_heads, ad.d_head)
    got = ad.run(ids, select=(), patch_reads=patch, logits=True)
    assert got.logits.dtype == torch.float32 and got.logits.shape == (B, T, model.config.vocab_size)
    with torch.no_grad(), patched_reads(model, patch):
        want = model(ids, use_cache=False).logits
    assert _maxdiff(got.logits, want) <= 1e-5
    # the patch really changed something, and only from the first patched position on (causality)
    assert _maxdiff(want, plain) > 1e-3
    first = POSITIONS[0]
    assert _maxdiff(got.logits[:, :first], plain[:, :first]) <= 1e-6
    assert _maxdiff(got.logits[:, first], plain[:, first]) > 1e-4


def test_patched_captures_follow_the_patched_forward(tiny):
    """Under a patch, `reads` is what attention computed and everything downstream is the patched forward."""
    model, ad, ids, _ = tiny
    patch = one_head_patch(ad.n_heads, ad.d_head, seed=1)

    def patch_both_layers(layer, reads):  # layer 0 too, so that layer 1's inputs move
        return patch(LAYER, reads) if layer == 0 else patch(layer, reads)

    caps = []
    ad.run(ids, on_layer=caps.append, patch_reads=patch_both_layers)
    ref = reference_run(model, ids, patch=patch_both_layers)
    for c, r in zip(caps, ref["layers"], strict=True):
        for field, key in (("resid_in", "resid_in"), ("attn_probs", "probs"), ("values", "values"),
                           ("reads", "reads"), ("attn_out", "attn_out"), ("mlp_out", "mlp_out")):
            assert _maxdiff(getattr(c, field), r[key]) <= 1e-5, (c.layer, field)
    unpatched = reference_run(model, ids)["layers"][1]
    assert _maxdiff(caps[1].resid_in, unpatched["resid_in"]) > 1e-4


def test_writing_own_reads_back_is_bit_identical(tiny):
    model, ad, ids, plain = tiny
    seen = []

    def same(layer, reads):
        seen.append(layer)
        return reads.clone()

    got = ad.run(ids, select=(), patch_reads=same, logits=True)
    assert seen == list(range(ad.n_layers))
    assert torch.equal(got.logits, plain.float())
    # and with no patch at all: the logits are HF's own
    assert torch.equal(ad.run(ids, select=(), logits=True).logits, plain.float())


def test_loss_is_cross_entropy_of_the_logits(tiny):
    model, ad, ids, plain = tiny
    res = ad.run(ids, select=(), loss=True)
    assert res.logits is None  # not asked for: not kept
    V = plain.shape[-1]
    want_tok = torch.nn.functional.cross_entropy(plain[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1), reduction="none")
    assert res.token_loss.shape == (B, T - 1)
    assert _maxdiff(res.token_loss, want_tok.view(B, T - 1)) <= 1e-5
    assert abs(res.loss.item() - torch.nn.functional.cross_entropy(plain[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).item()) <= 1e-5
    both = ad.run(ids, select=(), logits=True, loss=True)
    want = torch.nn.functional.cross_entropy(both.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    assert abs(both.loss.item() - want.item()) <= 1e-6  # the mean of token_loss: same terms, other summation order


@pytest.mark.parametrize(
    "select",
    [("attn_probs",), ("reads",), ("values", "mlp_out"), ("resid_mid",), ("attn_out", "resid_in")],
    ids=lambda s: "+".join(s),
)
def test_select_materialises_only_the_subset(tiny, select, monkeypatch):
    model, ad, ids, _ = tiny
    full = []
    ad.capture(ids, full.append)
    if "values" not in select:  # unselected values are never even extracted from the value projection
        monkeypatch.setattr(type(ad), "_values_from_src", lambda self, out: pytest.fail("values computed"))
    part = []
    res = ad.run(ids, select=select, on_layer=part.append)
    assert isinstance(res, RunResult) and res.logits is None and res.loss is None
    assert [c.layer for c in part] == list(range(ad.n_layers))
    for c, f in zip(part, full, strict=True):
        for name in CAPTURE_FIELDS:
            if name in select:
                assert torch.equal(getattr(c, name), getattr(f, name)), name
            else:
                assert getattr(c, name) is None, name


def test_select_forms_and_errors():
    model = make_tiny_model("gemma2")
    ad = get_adapter(model)
    ids = random_ids(B, T)
    caps = []
    ad.run(ids, select=lambda name: name.startswith("resid"), on_layer=caps.append)
    assert caps[0].resid_in is not None and caps[0].resid_mid is not None and caps[0].reads is None
    caps.clear()
    ad.run(ids, select="reads", on_layer=caps.append)
    assert caps[0].reads is not None and caps[0].attn_probs is None
    with pytest.raises(ValueError, match=r"unknown LayerCapture field.*'probs'.*attn_probs"):
        ad.run(ids, select=["probs"])
    with pytest.raises(ValueError, match=r"patch_reads\(layer=0\) returned \(2, 16, 64\).*\[B,T,H,dh\]"):
        ad.run(ids, select=(), patch_reads=lambda layer, r: r.flatten(2))
    with pytest.raises(ValueError, match="at least 2 positions"):
        ad.run(ids[:, :1], loss=True)
    bare = get_adapter(model.model)
    assert ad.has_lm_head and not bare.has_lm_head
    with pytest.raises(ValueError, match=r"get_adapter\(model\) on the \*ForCausalLM"):
        bare.run(ids, logits=True)
    bare_caps = []
    bare.run(ids, select="reads", on_layer=bare_caps.append, patch_reads=lambda layer, r: r)  # no LM head needed
    assert torch.equal(bare_caps[1].reads, caps[1].reads)


def test_patch_in_bfloat16_writes_back_in_model_dtype():
    """Reads reach the callback as float32 and go back in the model's dtype: writing them back is exact."""
    model = make_tiny_model("llama").to(torch.bfloat16)
    ad = get_adapter(model)
    ids = random_ids(B, T)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    got_dtypes = []

    def same(layer, reads):
        got_dtypes.append(reads.dtype)
        return reads

    res = ad.run(ids, select=(), patch_reads=same, logits=True)
    assert got_dtypes == [torch.float32] * ad.n_layers
    assert torch.equal(res.logits, plain.float())
    patch = one_head_patch(ad.n_heads, ad.d_head)
    with torch.no_grad(), patched_reads(model, patch):
        want = model(ids, use_cache=False).logits
    assert torch.equal(ad.run(ids, select=(), patch_reads=patch, logits=True).logits, want.float())
