"""The J-lens of App. P (mfpipe.jlens, mfpipe.models.adapters.jacobian) on tiny random models of the six paper
architectures: the estimated same-position Jacobians against central finite differences of a float64 copy of the
model (both insertion points, every layer), J = I at the final residual, the decode there equal to the raw logit lens
bit for bit, the seeded position sampling, and the store's round trip and provenance refusal."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from tiny_models import TINY_MODEL_TYPES, VOCAB, make_tiny_model

from mfpipe.jlens import lens as JL
from mfpipe.models.adapters import get_adapter
from mfpipe.models.adapters.jacobian import position_jacobians

T = 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _windows(n=5, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(n, T), dtype=np.int64)


@contextlib.contextmanager
def _true_float64():
    """Keep a float64 model float64 throughout: transformers' RMS norms and eager softmax compute in float32
    (``x.to(torch.float32)``, ``x.float()``, ``softmax(..., dtype=torch.float32)``), which would leave central
    differences with float32 noise (~1e-3 relative at eps 1e-4). Inside, those casts of float64 tensors are no-ops."""
    to, flt, sm = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax

    def to64(self, *a, **k):
        want = k.get("dtype", next((x for x in a if isinstance(x, torch.dtype)), None))
        if self.dtype == torch.float64 and want == torch.float32:
            k = {n: v for n, v in k.items() if n != "dtype"}
            a = tuple(x for x in a if not isinstance(x, torch.dtype))
            return to(self, *a, **k) if (a or k) else self
        return to(self, *a, **k)

    def float64(self):
        return self if self.dtype == torch.float64 else flt(self)

    def softmax(x, *a, dtype=None, **k):
        return sm(x, *a, dtype=None if x.dtype == torch.float64 else dtype, **k)

    torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to64, float64, softmax
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to, flt, sm


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _fd_jacobian(ad, ids_row, t, layer, point, eps=1e-4):
    """∂h^L_t / ∂x_t by central differences: 2d copies of the window, row j (d + j) with +eps (-eps) e_j added to
    x at position t, x the block input (point block) or the output projection's output (point attn)."""
    d = ad.d_model
    E = torch.cat([torch.eye(d), -torch.eye(d)]).to(ad.dtype) * eps  # [2d, d]
    ids = torch.as_tensor(ids_row)[None].repeat(2 * d, 1)
    seen = {}

    def add(x):
        x = x.clone()
        x[:, t] += E
        return x

    def pre(module, args, kwargs):
        x = add(_hidden(args, kwargs))
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def post(module, args, out):
        return add(out)

    def final(module, args, kwargs):
        seen["hL"] = _hidden(args, kwargs)

    hs = [ad.final_norm_module().register_forward_pre_hook(final, with_kwargs=True)]
    if point == "block" and layer < ad.n_layers:
        hs.append(ad.block_module(layer).register_forward_pre_hook(pre, with_kwargs=True))
    elif point == "attn":
        hs.append(ad.out_proj_module(layer).register_forward_hook(post))
    try:
        with torch.no_grad():
            ad.base(input_ids=ids, use_cache=False)
            if point == "block" and layer == ad.n_layers:  # the final residual itself: h^L + eps e_j
                seen["hL"] = add(seen["hL"])
    finally:
        for h in hs:
            h.remove()
    y = seen["hL"][:, t].double()
    return ((y[:d] - y[d:]) / (2 * eps)).T  # [out, in]


@pytest.mark.parametrize("mt", TINY_MODEL_TYPES)
def test_jacobian_equals_finite_differences(mt):
    """Acceptance: on a float64 copy of the model, J of every layer and both points equals the average of central
    finite differences over the same sampled positions (1e-5 relative); J at the final block point is the identity;
    the model's parameters and mode are left as they were."""
    model = copy.deepcopy(make_tiny_model(mt, seed=3)).double()
    ad = get_adapter(model)
    windows = _windows()
    with _true_float64():
        ds = JL.estimate_jlens(ad, windows, n_positions=3, seed=1, batch_size=2, progress=False, dtype=np.float64)
    L, d = ad.n_layers, ad.d_model
    assert ds["J"].shape == (2, L + 1, d, d) and list(ds["point"].values) == ["block", "attn"]
    assert np.isnan(ds["J"].sel(point="attn", layer=L)).all() and int(ds["n_positions"]) == 3
    w, p = JL.sample_positions(len(windows), T, 3, 1)
    np.testing.assert_array_equal(ds["sample_window"], w)
    np.testing.assert_array_equal(ds["sample_position"], p)
    for point, layers in (("block", range(L + 1)), ("attn", range(L))):
        for layer in layers:
            with _true_float64():
                fd = sum(_fd_jacobian(ad, windows[wi], int(ti), layer, point) for wi, ti in zip(w, p)) / len(w)
            J = ds["J"].sel(point=point, layer=layer).values
            scale = np.abs(fd.numpy()).max()
            assert scale > 0.1, (point, layer)
            np.testing.assert_allclose(J, fd.numpy(), rtol=0, atol=1e-5 * scale, err_msg=f"{mt} {point} {layer}")
    np.testing.assert_allclose(ds["J"].sel(point="block", layer=L), np.eye(d), rtol=0, atol=1e-6)
    assert all(p.requires_grad for p in model.parameters()) and not model.training


@pytest.mark.parametrize("mt", TINY_MODEL_TYPES)
def test_final_point_is_identity_and_decodes_as_the_raw_lens(mt, tmp_path):
    """Acceptance on the float32 model of each architecture (Gemma-2 with its logit soft-cap): J_L = I (1e-6), the
    J-lens decode at the final point equals the raw lens bit for bit, also after a store round trip; the batched
    backward equals one backward per output dimension."""
    model = make_tiny_model(mt, seed=2, **({"final_logit_softcapping": 2.0} if mt == "gemma2" else {}))
    ad = get_adapter(model)
    windows = _windows(4, seed=5)
    ds = JL.estimate_jlens(ad, windows, n_positions=6, seed=0, batch_size=4, progress=False)
    L, d = ad.n_layers, ad.d_model
    assert ds["J"].dtype == np.float32
    np.testing.assert_allclose(ds["J"].sel(point="block", layer=L), np.eye(d), rtol=0, atol=1e-6)
    assert np.isfinite(ds["J"].sel(point="attn", layer=slice(0, L - 1))).all()
    u = torch.randn(5, d, generator=torch.Generator().manual_seed(0))
    raw = JL.raw_decode(ad, u)
    assert torch.equal(JL.jlens_decode(ad, ds, L, "block", u), raw)
    torch.testing.assert_close(raw, ad.unembed(u), rtol=0, atol=0)
    # the J-lens at a middle point is a different readout
    assert not torch.allclose(JL.jlens_decode(ad, ds, 0, "attn", u), raw)
    path = JL.write_jlens(tmp_path / "jlens.zarr", ds, {"model": "tiny", "revision": "r1"})
    back = JL.open_jlens(path, {"model": "tiny", "revision": "r1", "model_type": ad.model_type})
    np.testing.assert_array_equal(back["J"].values, ds["J"].values)
    assert torch.equal(JL.jlens_decode(ad, back, L, "block", u), raw)
    ids, pos = torch.as_tensor(windows[:3]), torch.tensor([9, 1, 4])
    np.testing.assert_allclose(position_jacobians(ad, ids, pos, grad_chunk=1).numpy(),
                               position_jacobians(ad, ids, pos, grad_chunk=16).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mt", TINY_MODEL_TYPES)
def test_the_cached_prefix_gives_the_whole_window_jacobian(mt):
    """Each backward pass runs through token t alone, its prefix held as the model's key/value cache: on a float64
    copy of every architecture that equals the Jacobian of the whole window run (1e-10), for rows that share a
    position, rows that do not and position 0."""
    ad = get_adapter(copy.deepcopy(make_tiny_model(mt, seed=4)).double())
    ids, pos = torch.as_tensor(_windows(6, seed=2)), torch.tensor([7, 3, 7, 0, 9, 3])
    with _true_float64():
        cached = position_jacobians(ad, ids, pos, grad_chunk=8)
        whole = position_jacobians(ad, ids, pos, grad_chunk=8, prefix_cache=False)
    assert torch.isfinite(cached[0]).all() and torch.isnan(cached[1, -1]).all()
    scale = float(whole[0].abs().max())
    torch.testing.assert_close(cached, whole, rtol=0, atol=1e-10 * scale, equal_nan=True)
    if mt == TINY_MODEL_TYPES[0]:  # `rows` (the benchmark's share of the passes): the same first rows, NaN after
        with _true_float64():
            for form in (True, False):
                part = position_jacobians(ad, ids, pos, grad_chunk=8, prefix_cache=form, rows=5)
                torch.testing.assert_close(part[0, :, :5], whole[0, :, :5], rtol=0, atol=1e-10 * scale)
                assert torch.isnan(part[:, :, 5:]).all()


def test_a_model_without_a_usable_cache_runs_whole_windows(caplog):
    """A forward that takes no ``past_key_values``, or takes them and does not attend to them (its token would sit at
    position 0 of an empty context), falls back to whole windows, with a log line: the same Jacobian."""
    import logging

    ad = get_adapter(make_tiny_model("llama", seed=1))
    ids, pos = torch.as_tensor(_windows(3, seed=4)), torch.tensor([5, 2, 8])
    whole = position_jacobians(ad, ids, pos, prefix_cache=False)
    forward = ad.base.forward

    def refuses(*a, past_key_values=None, use_cache=None, **k):
        if past_key_values is not None or use_cache:
            raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")
        return forward(*a, use_cache=False, **k)

    def ignores(*a, past_key_values=None, use_cache=None, **k):
        return forward(*a, use_cache=past_key_values is None and bool(use_cache), **k)

    for shim, said in ((refuses, "unexpected keyword"), (ignores, "another final residual")):
        ad.base.forward = shim
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="mfpipe.models.adapters.jacobian"):
                got = position_jacobians(ad, ids, pos)
        finally:
            del ad.base.forward
        assert any(said in r.getMessage() and "whole" in r.getMessage() for r in caplog.records), caplog.text
        torch.testing.assert_close(got, whole, rtol=0, atol=0, equal_nan=True)


def test_position_sampling_is_seeded_and_skips_bos():
    w, p = JL.sample_positions(7, 12, 100, seed=4)
    assert p.min() >= 1 and p.max() <= 11 and len(set(p.tolist())) > 5
    assert sorted(np.bincount(w, minlength=7).tolist()) == [14] * 5 + [15] * 2  # every window, evenly
    w2, p2 = JL.sample_positions(7, 12, 100, seed=4)
    np.testing.assert_array_equal(w, w2)
    np.testing.assert_array_equal(p, p2)
    assert not np.array_equal(p, JL.sample_positions(7, 12, 100, seed=5)[1])
    with pytest.raises(ValueError, match="at least one window"):
        JL.sample_positions(3, 1, 10, 0)


def test_store_of_another_model_is_refused(tmp_path):
    ad = get_adapter(make_tiny_model("gpt2", seed=0))
    ds = JL.estimate_jlens(ad, _windows(3), n_positions=2, seed=0, batch_size=2, progress=False)
    prov = {"model": "mini-a", "revision": "final", "corpus_fingerprint": "abc", "half": "stats"}
    path = JL.write_jlens(tmp_path / "jlens.zarr", ds, prov)
    assert JL.open_jlens(path, prov).attrs["n_positions"] == 2
    for key, other in (("model", "mini-b"), ("revision", "step-100"), ("corpus_fingerprint", "def")):
        with pytest.raises(JL.JLensProvenanceError, match=rf"J-lens store .*jlens.zarr was computed for {key} "
                                                           rf"'{prov[key]}', expected '{other}'") as e:
            JL.open_jlens(path, {**prov, key: other})
        assert "\n" not in str(e.value) and "rerun the jlens job" in str(e.value)
    with pytest.raises(JL.JLensProvenanceError, match="records no 'tokenizer'"):
        JL.open_jlens(path, {"tokenizer": "x"})
    with pytest.raises(FileNotFoundError, match="J-lens store .* run its jlens job"):
        JL.open_jlens(tmp_path / "missing.zarr")
    with pytest.raises(ValueError, match="no J at point 'attn', layer 2"):
        JL.jlens_decode(ad, ds, 2, "attn", torch.zeros(1, ad.d_model))
    other = get_adapter(make_tiny_model("gpt2", seed=0, n_embd=32))
    with pytest.raises(ValueError, match="another model"):
        JL.jlens_decode(other, ds, 0, "block", torch.zeros(1, 32))
