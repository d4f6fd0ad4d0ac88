"""Issue 59: an attention sink applied after the softmax as a factor of the reads (Granite-SWA's and Granite-MoE-SWA's
``(softmax(scores) @ V) * sigmoid(logsumexp(scores) - sinks)``, mfpipe.models.adapters.sinks).

The site's probabilities are the probabilities behind the reads: the returned weights times the factor, against a
reference that knows nothing of the tap (the factor as the ratio ``<reads, PV> / |PV|^2`` of plain hooks' tensors);
their rows sum below 1; conformance passes; the tap's mode never outlives a forward (the site's early stop, a callback
that raises inside the attention), adapters share one tap per module, and a factor of another form is refused."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers
from tiny_models import make_tiny_model, random_ids

from mfpipe import conformance
from mfpipe.models.adapters import UnsupportedArchitectureError, describe, get_adapter
from mfpipe.models.adapters.unplaced import explain

FAMILIES = ("granite_swa", "granitemoe_swa")
SINKS = torch.tensor([2.0, -2.0, 2.0, -2.0])  # per head: a sink far above and far below the scores' logsumexp


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def sinked(family: str, seed: int = 3):
    model = make_tiny_model(family, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(SINKS)
    return model


def hooked(model, ids):
    """Per layer (returned weights [B,H,T,T], values [B,H,T,dh] with KV heads expanded, reads [B,T,H,dh]) of one
    plain forward, from plain torch hooks on the attention, its value projection and its output projection."""
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    rec, handles = {}, []
    for l, layer in enumerate(model.model.layers):
        a = layer.self_attn
        handles += [a.register_forward_hook(lambda m, args, out, l=l: rec.__setitem__(("w", l), out[1])),
                    a.v_proj.register_forward_hook(lambda m, args, out, l=l: rec.__setitem__(("v", l), out)),
                    a.o_proj.register_forward_pre_hook(lambda m, args, l=l: rec.__setitem__(("r", l), args[0]))]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    B, T = ids.shape
    out = []
    for l in range(len(model.model.layers)):
        v = rec[("v", l)].double().view(B, T, KV, dh).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        out.append((rec[("w", l)].double(), v, rec[("r", l)].double().view(B, T, H, dh)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_site_reads_the_probabilities_behind_the_reads(family):
    model = sinked(family)
    ad = get_adapter(model)
    assert ad.structure.attn_sink == "self_attn.sinks"
    ids = random_ids(2, 16, seed=1)
    caps = []
    ad.run(ids, select=("attn_probs",), on_layer=caps.append)
    for c, (w, v, reads) in zip(caps, hooked(model, ids)):
        pv = torch.einsum("bhqk,bhkd->bqhd", w, v)
        factor = (reads * pv).sum(-1) / (pv * pv).sum(-1)  # [B,T,H]: what the reads are of the returned weights' read
        want = w * factor.transpose(1, 2)[..., None]
        assert float((c.attn_probs.double() - want).abs().max()) <= 1e-6
        # the test can fail: the returned weights themselves are far off, and the factor is far from 1 on some heads
        assert float((w - want).abs().max()) > 0.05 and float(factor.min()) < 0.5
        rows = c.attn_probs.sum(-1)
        assert bool((rows < 1).all()) and bool((rows > 0).all())
    assert torch._C._len_torch_function_stack() == 0  # the site stopped after the last layer: the mode was popped


@pytest.mark.parametrize("family", FAMILIES)
def test_conformance_passes(family):
    rows = conformance.check_model(sinked(family, seed=2))
    assert all(r.ok for r in rows) and len(rows) == 15, conformance.table(rows)


def test_the_mode_never_outlives_a_forward_and_taps_are_shared():
    model = sinked("granite_swa")
    ad = get_adapter(model)
    attn = model.model.layers[0].self_attn

    def boom(layer, reads):  # raised at the output projection's input: inside the attention's forward
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        ad.run(random_ids(1, 8), patch_reads=boom)
    assert torch._C._len_torch_function_stack() == 0
    n_hooks = len(attn._forward_pre_hooks), len(attn._forward_hooks)
    again = get_adapter(model)  # describe's one-shot probe tap removed itself; the adapters' tap is one per module
    assert (len(attn._forward_pre_hooks), len(attn._forward_hooks)) == n_hooks
    assert again.sink_tap(0) is ad.sink_tap(0)
    got = again.run(random_ids(1, 8), logits=True).logits  # and the forward with the tap is the model's own
    with torch.no_grad():
        assert torch.equal(got, model(random_ids(1, 8), use_cache=False).logits)


def test_a_tapped_model_is_freed():
    """The shared taps (a dict weakly keyed by module) keep no model alive once its adapters are gone."""
    model = sinked("granite_swa")
    ad = get_adapter(model)
    ad.run(random_ids(1, 8), select=("attn_probs",))
    refs = [weakref.ref(model), weakref.ref(model.model.layers[0].self_attn)]  # the tapped module itself too
    del model, ad
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_factor_of_another_form_is_refused(monkeypatch):
    """The probe checks the form rather than assuming it: reads times another factor than the sink's are refused, and
    the refusal's explanation (the census's) says so."""
    mod = transformers.models.granite_swa.modeling_granite_swa
    own = mod.eager_attention_forward

    def drifted(*args, **kwargs):
        out, weights = own(*args, **kwargs)
        return out * 0.9, weights

    monkeypatch.setattr(mod, "eager_attention_forward", drifted)
    model = sinked("granite_swa")
    with pytest.raises(UnsupportedArchitectureError, match="cannot place the value projection") as e:
        describe(model)
    assert "(its sinks parameter: an attention sink, its factor not sigmoid(logsumexp(scores) - sink)" in explain(
        e.value, model).reason


def test_a_model_without_a_sink_has_no_tap():
    model = make_tiny_model("llama")
    assert describe(model).attn_sink is None
    assert get_adapter(model).sink_tap(0) is None
    assert not model.model.layers[0].self_attn._forward_pre_hooks
