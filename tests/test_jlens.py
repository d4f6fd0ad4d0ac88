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

from mfpipe.jlens import checks as C
from mfpipe.jlens import lens as JL
from mfpipe.models.adapters import get_adapter
from mfpipe.models.adapters.jacobian import position_jacobians
from mfpipe.models.adapters.streaming import saved_from_checkpoint

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


def _saved_as_is():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _graph_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and o.grad_fn is not None)


@pytest.mark.parametrize("chunk", [1, 4, 64])  # a row a call, several calls, one batched call holding every row
def test_no_graph_outlives_the_jacobians(chunk):
    """The backward passes free the graph of each position when they are done: under saved-tensor hooks that save a
    tensor as itself (the streamed backward's, which the lens installed for every model) a retained graph is a
    reference cycle the collector cannot free, and the J-lens job held every position's graph to its end (GPT-2
    small's paper-shape job peaked at 2,807 MiB, 1,790 with the graphs freed)."""
    ad = get_adapter(make_tiny_model(TINY_MODEL_TYPES[0], seed=4))
    ids, pos = torch.as_tensor(_windows(4, seed=3)), torch.tensor([6, 2, 6, 9])
    before = _graph_tensors()
    for form, hooks in ((True, saved_from_checkpoint), (False, saved_from_checkpoint), (True, _saved_as_is)):
        with hooks():  # (the lens's, where no model is streamed; hooks that save tensors as themselves)
            J = position_jacobians(ad, ids, pos, grad_chunk=chunk, prefix_cache=form)
        assert torch.isfinite(J[0]).all()
        assert _graph_tensors() == before, (chunk, form, hooks.__name__)


def test_a_model_without_a_usable_cache_runs_whole_windows(caplog):
    """A forward that takes no ``past_key_values``, or takes them and does not attend to them (its token would sit at
    position 0 of an empty context), falls back to whole windows, with a log line: the same Jacobian. Sums added to
    a caller's (``into``) get the window's once: the cache is refused before anything is added (position 0, which
    needs none, comes last)."""
    import logging

    ad = get_adapter(make_tiny_model("llama", seed=1))
    ids, pos = torch.as_tensor(_windows(3, seed=4)), torch.tensor([5, 0, 8])
    whole = position_jacobians(ad, ids, pos, prefix_cache=False)
    start = position_jacobians(ad, ids[:1], pos[:1])  # what a caller summed before
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
                into = start.clone()
                assert position_jacobians(ad, ids, pos, into=into) is into
        finally:
            del ad.base.forward
        assert any(said in r.getMessage() and "whole" in r.getMessage() for r in caplog.records), caplog.text
        torch.testing.assert_close(got, whole, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(into, start + whole, rtol=0, atol=1e-12 * float(whole[0].abs().max()),
                                   equal_nan=True)


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


# ------------------------------------------------------------------ the J-lens checks (mfpipe.jlens.checks, .agreement)
def _frob(x):
    return float(np.sqrt((np.asarray(x, dtype=np.float64) ** 2).sum()))


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_group_sums_leave_the_total_bit_for_bit_and_sum_to_it(prefix_cache):
    """``groups``: the total is the ungrouped call's bit for bit; the groups' sums add up to the total's kept rows
    (1e-12 relative), each group's sum is the Jacobian of its own rows alone, a group without rows sums to 0, and kept
    rows past ``rows`` are NaN; the same with one backward per output dimension."""
    ad = get_adapter(make_tiny_model("llama", seed=1))
    ids, pos = torch.as_tensor(_windows(6, seed=3)), torch.tensor([4, 2, 4, 9, 1, 4])
    groups = torch.tensor([0, 2, 2, 0, 3, 3])  # group 1 empty; the rows of t = 4 in groups 0, 2, 3
    keep = torch.tensor([17, 0, 63, 5, 40])  # unsorted, both ends
    for chunk in (8, 1):
        plain = position_jacobians(ad, ids, pos, grad_chunk=chunk, prefix_cache=prefix_cache)
        total, by = position_jacobians(ad, ids, pos, grad_chunk=chunk, prefix_cache=prefix_cache, groups=groups,
                                       group_rows=keep, n_groups=4)
        assert torch.equal(total.nan_to_num(7.0), plain.nan_to_num(7.0))
        L = ad.n_layers
        assert by.shape == (4, 2, L + 1, len(keep), ad.d_model) and by.dtype == torch.float64
        assert torch.isnan(by[:, 1, L]).all() and torch.isfinite(by[:, 0]).all() and (by[1, :, :L] == 0).all()
        want = total[:, :, keep]
        scale = float(want[0].abs().max())
        torch.testing.assert_close(by.sum(0), want, rtol=0, atol=1e-12 * scale, equal_nan=True)
        for g in (0, 2, 3):
            alone = position_jacobians(ad, ids[groups == g], pos[groups == g], grad_chunk=chunk,
                                       prefix_cache=prefix_cache)
            torch.testing.assert_close(by[g], alone[:, :, keep], rtol=0, atol=1e-5 * scale, equal_nan=True)
    _, part = position_jacobians(ad, ids, pos, rows=20, groups=groups, group_rows=keep, prefix_cache=prefix_cache)
    assert part.shape[0] == 4  # n_groups: max + 1
    assert torch.isnan(part[:, :, :, [2, 4]]).all() and torch.isfinite(part[:, 0, :, [0, 1, 3]]).all()
    with pytest.raises(ValueError, match="group_rows"):
        position_jacobians(ad, ids, pos, groups=groups, group_rows=[64])


def _direct_checks(ad, windows, n, seed, keep):
    """The split-half and nested-prefix differences from separate sums over the respective samples."""
    win, pos = JL.sample_positions(len(windows), T, n, seed)

    def mean(sel):
        sel = np.asarray(sel)
        J = position_jacobians(ad, torch.as_tensor(windows[win[sel]]), torch.from_numpy(pos[sel])) / len(sel)
        return J[:, :, keep].numpy()

    full = mean(np.arange(n))
    L = ad.n_layers
    split = np.full((2, L + 1), np.nan)
    conv = {}
    for p, l in [(0, l) for l in range(L + 1)] + [(1, l) for l in range(L)]:
        norm = _frob(full[p, l])
        if n >= 2:
            a, b = mean(np.arange(n // 2)), mean(np.arange(n // 2, n))
            split[p, l] = _frob(a[p, l] - b[p, l]) / norm
        for k in sorted({n // 8, n // 4, n // 2} - {0}):
            conv[p, l, k] = _frob(mean(np.arange(k))[p, l] - full[p, l]) / norm
    return split, conv


@pytest.mark.parametrize("n, check_rows", [(16, 256), (16, 20), (3, 256), (1, 256)])
def test_split_half_and_convergence_equal_a_direct_recomputation(n, check_rows):
    """Acceptance: ``check_split_half`` and ``check_convergence`` equal the relative Frobenius differences of means
    computed apart over the two halves of the sampled order and over its first n/8, n/4, n/2 samples (1e-6), on all
    rows or on a seeded subset of them (recorded in the attrs); 0 at n itself, NaN at (attn, L); J is the estimate
    without checks bit for bit. Tiny n: only the positive prefix sizes, no split half for n = 1."""
    ad = get_adapter(make_tiny_model("gpt2", seed=6))
    windows, seed = _windows(5, seed=8), 2
    ds = JL.estimate_jlens(ad, windows, n_positions=n, seed=seed, batch_size=4, progress=False, check_rows=check_rows)
    bare = JL.estimate_jlens(ad, windows, n_positions=n, seed=seed, batch_size=4, progress=False, check_rows=None)
    assert "check_split_half" not in bare
    np.testing.assert_array_equal(ds["J"].values, bare["J"].values)
    d, L = ad.d_model, ad.n_layers
    keep = np.asarray(ds.attrs["check_rows"])
    if check_rows >= d:
        np.testing.assert_array_equal(keep, np.arange(d))
    else:
        assert len(keep) == check_rows and len(set(keep.tolist())) == check_rows and keep.max() < d
        np.testing.assert_array_equal(keep, C.check_row_indices(d, check_rows, seed + 2))
        assert not np.array_equal(keep, np.arange(check_rows))
    sizes = {16: [2, 4, 8, 16], 3: [1, 3], 1: [1]}[n]
    assert ds["n_check"].values.tolist() == sizes == C.check_sizes(n)
    split, conv = _direct_checks(ad, windows, n, seed, keep)
    got = ds["check_split_half"].values
    np.testing.assert_allclose(got, split, rtol=1e-6, atol=1e-9)
    assert np.isnan(got[1, L]) and (n < 2 or np.isfinite(got[:, :L]).all())
    if n >= 2:
        assert got[0, :L].min() > 1e-3  # the halves' estimates differ below the final point
    for (p, l, k), want in conv.items():
        np.testing.assert_allclose(ds["check_convergence"].values[p, l, sizes.index(k)], want, rtol=1e-6, atol=1e-9)
    assert (ds["check_convergence"].sel(n_check=n).values[0] == 0).all()
    assert np.isnan(ds["check_convergence"].values[1, L]).all()


def test_sample_blocks_are_nested_prefixes_of_the_sampled_order():
    assert C.sample_bounds(256) == [0, 32, 64, 128, 256] and C.check_sizes(256) == [32, 64, 128, 256]
    g = C.sample_groups(20)  # bounds 0, 2, 5, 10, 20
    assert g.tolist() == [0] * 2 + [1] * 3 + [2] * 5 + [3] * 10
    assert C.sample_groups(3).tolist() == [2, 3, 3] and C.check_sizes(6) == [1, 3, 6]
    with pytest.raises(ValueError, match="at least one output dimension"):
        C.check_row_indices(8, 0, 0)


def _direct_vectors(ad, windows, win, pos, layer):
    """Block `layer`'s input and each head's write at its output projection (the projection applied to that head's
    read alone, less the bias) at (window, position), one plain forward per window."""
    seen = {}
    proj = ad.out_proj_module(layer)
    H, dh = ad.n_heads, ad.d_head
    hooks = [ad.block_module(layer).register_forward_pre_hook(
                 lambda m, a, k: seen.__setitem__("resid", _hidden(a, k)), with_kwargs=True),
             proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("reads", a[0]))]
    resid, writes = [], []
    try:
        with torch.no_grad():
            for w, t in zip(win, pos):
                ad.base(input_ids=torch.as_tensor(windows[w])[None], use_cache=False)
                resid.append(seen["resid"][0, t])
                r = seen["reads"][0, t].reshape(H, dh)
                for h in range(H):
                    only = torch.zeros(H, dh)
                    only[h] = r[h]
                    writes.append(proj(only.reshape(1, H * dh))[0] - proj(torch.zeros(1, H * dh))[0])
    finally:
        for x in hooks:
            x.remove()
    return torch.stack(resid), torch.stack(writes)


def _direct_agreement(ad, J, u):
    raw = ad.unembed(u)
    lens = ad.unembed((u.double() @ torch.as_tensor(J).T).float())
    top1 = float((raw.argmax(-1) == lens.argmax(-1)).double().mean())
    a, b = raw.topk(10).indices, lens.topk(10).indices
    top10 = float(np.mean([len(set(x.tolist()) & set(y.tolist())) / 10 for x, y in zip(a, b)]))
    return top1, top10


def test_decode_agreement_is_exact_at_the_final_point_and_equals_a_direct_comparison():
    """Acceptance: at (block, L) the raw and J-lens decodes agree exactly (1, 1); at the other layers (both points)
    the table's top-1 agreement and top-10 overlap equal a direct comparison of argmaxes and top-10 sets of vectors
    read apart (plain hooks, each head's write as the projection of its read alone) at the positions of seed + 1."""
    from mfpipe.jlens import agreement as A

    ad = get_adapter(make_tiny_model("gpt2", seed=2))
    windows = _windows(6, seed=1)
    ds = JL.estimate_jlens(ad, windows, n_positions=8, seed=4, batch_size=4, progress=False)
    df = A.decode_agreement(ad, ds, windows, n_decode=7, batch_size=3)
    L, H = ad.n_layers, ad.n_heads
    assert [(r.point, r.layer) for r in df.itertuples()] == [("block", l) for l in range(L + 1)] + [
        ("attn", l) for l in range(L)]
    last = df.set_index(["point", "layer"]).loc[("block", L)]
    assert last["top1_agreement"] == 1.0 and last["top10_overlap"] == 1.0 and last["n_vectors"] == 7
    win, pos = JL.sample_positions(len(windows), T, 7, 4 + 1)
    vectors = A.decode_vectors(ad, windows, n_decode=7, seed=5, batch_size=3)
    for layer in range(L):
        resid, writes = _direct_vectors(ad, windows, win, pos, layer)
        torch.testing.assert_close(vectors["attn", layer], writes, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(vectors["block", layer], resid, rtol=1e-5, atol=1e-6)
        for point, u in (("block", resid), ("attn", writes)):
            row = df.set_index(["point", "layer"]).loc[(point, layer)]
            top1, top10 = _direct_agreement(ad, JL.jlens_matrix(ds, layer, point), u)
            assert row["n_vectors"] == len(u) == (7 if point == "block" else 7 * H) and row["n_decode"] == 7
            assert row["top1_agreement"] == pytest.approx(top1, abs=1e-12)
            assert row["top10_overlap"] == pytest.approx(top10, abs=1e-12)
            assert top10 < 1.0  # the two lenses differ below the final point of a random model


class _Output(list):
    """Snakemake's output: positional and named."""

    def __init__(self, store, **named):
        super().__init__([str(store), *map(str, named.values())])
        self.__dict__.update({k: str(v) for k, v in named.items()})


def test_the_jlens_job_writes_its_store_and_a_checks_table_row_per_point_and_layer(tmp_path):
    """Acceptance: the jlens job writes the store (J as estimate_jlens gives it, with its checks) and the checks table,
    CSV and Markdown, one row per (point, layer) where J is estimated, with the sample checks, the decode agreement
    and a title and column paragraph in the Markdown; a summary line per row in the log."""
    import json
    import logging
    from types import SimpleNamespace

    import pandas as pd

    from mfpipe.corpus.windows import Shard, write_shards
    from mfpipe.jlens.jobs import jlens

    model = make_tiny_model("gpt2", seed=2)
    ad = get_adapter(model)
    windows = _windows(6, seed=1)
    shards = tmp_path / "shards"
    write_shards(Shard(windows.astype(np.int32), np.zeros_like(windows, dtype=np.int32)), shards / "stats", 4)
    (shards / "fingerprint.json").write_text(json.dumps({"fingerprint": "fp", "corpus": "c"}))
    params = SimpleNamespace(model_spec={"name": "tiny"}, revision="final", commit=None, n_positions=16, seed=4,
                             batch_size=4, grad_chunk=16, check_rows=256, n_decode=5,
                             sum_dtype="float64")
    out = _Output(tmp_path / "jlens.zarr", table=tmp_path / "checks.csv", md=tmp_path / "checks.md")
    log = logging.getLogger("test_jlens_job")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    job = SimpleNamespace(params=params, log=log, input=SimpleNamespace(shards=str(shards)), output=out,
                          model=lambda **kw: (model, ad))
    try:
        jlens(job)
    finally:
        log.removeHandler(handler)
    ds = JL.open_jlens(out[0], {"model": "tiny", "revision": "final", "corpus_fingerprint": "fp"})
    want = JL.estimate_jlens(ad, windows, n_positions=16, seed=4, batch_size=4, progress=False)
    np.testing.assert_array_equal(ds["J"].values, want["J"].values)
    np.testing.assert_array_equal(ds["check_split_half"].values, want["check_split_half"].values)
    df = pd.read_csv(out.table)
    L = ad.n_layers
    assert [(r.point, r.layer) for r in df.itertuples()] == [("block", l) for l in range(L + 1)] + [
        ("attn", l) for l in range(L)]
    assert list(df.columns) == ["point", "layer", "n_positions", "check_rows", "split_half_rel_diff", "rel_diff_n2",
                                "rel_diff_n4", "rel_diff_n8", "rel_diff_n16", "top1_agreement", "top10_overlap",
                                "n_decode", "n_vectors"]
    assert (df["n_positions"] == 16).all() and (df["check_rows"] == ad.d_model).all() and (df["rel_diff_n16"] == 0).all()
    np.testing.assert_allclose(df["split_half_rel_diff"], [float(ds["check_split_half"].sel(point=p, layer=l))
                                                           for p, l in zip(df["point"], df["layer"])], rtol=1e-12)
    final = df[(df["point"] == "block") & (df["layer"] == L)].iloc[0]
    assert final["top1_agreement"] == 1.0 and final["split_half_rel_diff"] == 0.0
    md = (tmp_path / "checks.md").read_text()
    assert md.startswith("# J-lens checks: tiny @ final\n\n") and "`split_half_rel_diff`: ||J_A - J_B||_F" in md
    assert md.count("\n| block |") == L + 1 and md.count("\n| attn |") == L
    lines = [r.getMessage() for r in records if "split-half rel. diff" in r.getMessage()]
    assert len(lines) == len(df) and "top-1 1.000" in lines[L]


def test_the_default_target_asks_for_the_checks_table_at_every_rollout_revision(tmp_path):
    from pathlib import Path

    from mfpipe.jlens import rules as jlens_rules
    from mfpipe.workflow.plan import Plan

    config = {"results": str(tmp_path / "results"), "corpus": {"name": "main"},
              "models": [{"name": "mini", "source": "minisuite", "revisions": ["step4", "step8"],
                          "rollout_revisions": ["step4", "step8"]},
                         {"name": "hub", "source": "hub", "hub_id": "org/hub", "revisions": ["a", "main"]}],
              "minisuite": {"models": [{"name": "mini", "steps": 8}]}}
    R = tmp_path / "results"
    assert jlens_rules.targets(Plan(config, Path("src"), None)) == [
        f"{R}/tables/jlens_checks_{m}_{rev}.{e}" for m, rev in (("mini", "step4"), ("mini", "step8"), ("hub", "main"))
        for e in ("csv", "md")]
