"""Pass 2 and the mean-field deviation (issue 11): the covariance / contextualization split and its meters against
the paper's exact identities, the pass-2 sums against a per-position loop over a plain HF/torch-hook reference on
tiny random models of every architecture, shard merging, and the deviation store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import head_maps
from stats_reference import reference_capture, tiny_stats_half
from tiny_models import TINY_MODEL_TYPES

from mfpipe.deviation import shards as DP
from mfpipe.deviation.pass2 import window_halves
from mfpipe.deviation.queries import query_terms
from mfpipe.meanfield.plan import query_plan
from mfpipe.meanfield.ccmf import pair_kernel
from mfpipe.meanfield.deviation import corpus_deviation, layer_grams, meters, occurrence_terms
from mfpipe.meanfield.kernel import kernel_from_store
from mfpipe.stats.errors import StatsError
from mfpipe.stats.buckets import window_buckets

N_WIN = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=TINY_MODEL_TYPES + ("mixtral",))  # + a mixture of experts (issue 48)
def setup(request, tmp_path_factory):
    mt = request.param
    model, ad, tokens, tracked, sums, meta, st = tiny_stats_half(mt, tmp_path_factory.mktemp(f"dev-{mt}"), model_seed=7,
                                                                 n_windows=N_WIN, token_seed=3, batch_size=6)
    doc_ids = np.repeat(np.arange(N_WIN)[:, None] // 3, tokens.shape[1], axis=1)  # documents of 3 windows
    return mt, model, ad, tracked, st, tokens, doc_ids


def slow_pass2(model, tokens, doc_ids, tracked, kernel):
    """Per window, position, layer and head: A_t, v̄_t, Â_t by loops over the prefix's key types (float64, residual
    units through O_h), accumulated like pass 2."""
    ref = reference_capture(model, torch.as_tensor(tokens.astype(np.int64)))
    W, mu = kernel.W.double().numpy(), kernel.mu.double().numpy()
    L, H, N, K = W.shape
    dh = mu.shape[-1]
    B, T = tokens.shape
    O = [head_maps(model, l) for l in range(L)]
    half = window_halves(doc_ids)
    out = {k: np.zeros((2, L, H, N)) for k in ("D_sum", "M_cov_sum", "M_ctx_sum")}
    out.update({k: np.zeros((2, L, H, N, dh)) for k in ("z_sum", "zhat_sum")})
    out["vbar_tracked_sum"] = np.zeros((L, H, N, dh))
    out["count"] = np.zeros((2, L, N), dtype=np.int64)
    for b in range(B):
        for j in range(1, T):
            s = int(kernel.query_lut[tokens[b, j]])
            if s < 0:
                continue
            bk = [N] + [int(kernel.key_lut[tokens[b, i]]) for i in range(1, j + 1)]
            types = sorted(set(bk))
            for l in range(L):
                out["count"][half[b], l, s] += 1
                for h in range(H):
                    p = ref["probs"][l, b, h, j, : j + 1]
                    v = ref["values"][l, b, h, : j + 1]
                    nx = sum(bk.count(t) * W[l, h, s, t] for t in types)
                    z = ref["reads"][l, b, j, h]
                    zhat = np.zeros(dh)
                    mixed = np.zeros(dh)
                    y = np.zeros(dh)
                    for t in types:
                        m = np.array([k == t for k in bk])
                        A_t = p[m].sum()
                        vbar = (p[m, None] * v[m]).sum(0) / A_t
                        Ahat = bk.count(t) * W[l, h, s, t] / nx
                        zhat += Ahat * mu[l, h, t]
                        mixed += Ahat * vbar
                        if t < N:  # tracked key types only
                            y += W[l, h, s, t] * bk.count(t) * vbar
                    zr, hr, xr = z @ O[l][h], zhat @ O[l][h], mixed @ O[l][h]
                    D = 1 - zr @ hr / np.sqrt((zr @ zr) * (hr @ hr))
                    e = zr - hr
                    ep = e - (e @ hr) / (hr @ hr) * hr
                    sc, sx = (zr - xr) @ ep / (ep @ ep), (xr - hr) @ ep / (ep @ ep)
                    for k, x in (("D_sum", D), ("M_cov_sum", sc * D), ("M_ctx_sum", sx * D)):
                        out[k][half[b], l, h, s] += x
                    out["z_sum"][half[b], l, h, s] += z
                    out["zhat_sum"][half[b], l, h, s] += zhat
                    out["vbar_tracked_sum"][l, h, s] += y
    return out


def test_pass2_equals_per_position_reference(setup):
    """Acceptance: pass-2 statistics equal a slow per-position reference (1e-5), every architecture."""
    mt, model, ad, tracked, st, tokens, doc_ids = setup
    sums, meta = DP.deviation_shard(model, ad, tokens, doc_ids, tracked, st, min_count=1, batch_size=5, progress=False)
    kernel = kernel_from_store(st, tracked, min_count=1)
    ref = slow_pass2(model, tokens, doc_ids, tracked, kernel)
    np.testing.assert_array_equal(sums["count"], ref["count"])
    assert sums["count"].sum() > 0 and (sums["count"][1] > 0).any() and (sums["count"][0] > 0).any()
    for k in ("D_sum", "M_cov_sum", "M_ctx_sum", "z_sum", "zhat_sum", "vbar_tracked_sum"):
        scale = max(1.0, float(np.abs(ref[k]).max()))
        np.testing.assert_allclose(sums[k], ref[k], rtol=0, atol=1e-5 * scale, err_msg=f"{mt}: {k}")
    assert meta["model"] == "tiny" and meta["stats_fingerprint"]


def test_meters_sum_to_the_deviation_and_terms_to_the_error(setup):
    """Acceptance: M_cov + M_ctx = D per occurrence (1e-6); (a) + (b) = z − ẑ exactly (1e-6)."""
    mt, model, ad, tracked, st, tokens, doc_ids = setup
    kernel = kernel_from_store(st, tracked, min_count=1)
    kb, qt = (torch.from_numpy(x) for x in window_buckets(tokens, kernel.key_lut, kernel.query_lut, kernel.n))
    grams = layer_grams(ad)
    seen = []

    def on_layer(cap):
        a, _, valid = pair_kernel(kernel.W[cap.layer], kb, qt)
        t = occurrence_terms(cap.attn_probs, cap.values, a.transpose(0, 1), kernel.mu[cap.layer], kb, reads=cap.reads)
        m = meters(t, grams[cap.layer])
        v = valid
        err = (t.z - t.zhat)[v]
        np.testing.assert_allclose((t.covariance + t.contextualization)[v], err, atol=1e-6)
        np.testing.assert_allclose((m["M_cov"] + m["M_ctx"])[v], m["D"][v], atol=1e-6)
        np.testing.assert_allclose((m["sigma_cov"] + m["sigma_ctx"])[v], 1.0, atol=1e-6)
        assert not m["degenerate"][v].any()
        # the split is not trivial: both terms carry part of the deviation somewhere
        assert (m["sigma_cov"][v].abs() > 0.05).any() and (m["sigma_ctx"][v].abs() > 0.05).any()
        # the mixed term by its definition at the last query of window 0: each key bucket's Â mass spread over that
        # bucket's keys as the model's attention spreads it (Â itself where the model gives the bucket nothing)
        A, Ah, vals, i = cap.attn_probs[0].double(), a.transpose(0, 1)[0].double(), cap.values[0].double(), -1
        for h in range(A.shape[0]):
            want = torch.zeros(vals.shape[-1], dtype=torch.float64)
            for kt in kb[0].unique():
                keys = kb[0] == kt
                mass, share = Ah[h, i, keys].sum(), A[h, i, keys].sum()
                w = Ah[h, i, keys] if share <= 0 else mass * A[h, i, keys] / share
                want += w @ vals[h, keys]
            np.testing.assert_allclose(t.mixed[0, i, h].double(), want, atol=1e-5)
        # z is the head's read Σ A v
        zr = torch.matmul(cap.attn_probs, cap.values).transpose(1, 2)
        np.testing.assert_allclose(zr[v], cap.reads[v], atol=1e-5)
        seen.append(cap.layer)

    ad.run(torch.as_tensor(tokens.astype(np.int64)), select=("attn_probs", "values", "reads"), on_layer=on_layer)
    assert seen == list(range(ad.n_layers))


def test_meters_fail_when_the_mixed_term_is_wrong(setup):
    """The identities are not tautologies of the code: the shares use the real a and b, so a wrong mixed term
    breaks σ_cov + σ_ctx = 1 only if the shares are computed from separate terms — check the shares move."""
    mt, model, ad, tracked, st, tokens, doc_ids = setup
    if mt != "gpt2":
        pytest.skip("one architecture suffices")
    kernel = kernel_from_store(st, tracked, min_count=1)
    kb, qt = (torch.from_numpy(x) for x in window_buckets(tokens, kernel.key_lut, kernel.query_lut, kernel.n))
    grams = layer_grams(ad)
    res = {}

    def on_layer(cap):
        if cap.layer:
            return
        a, _, valid = pair_kernel(kernel.W[0], kb, qt)
        t = occurrence_terms(cap.attn_probs, cap.values, a.transpose(0, 1), kernel.mu[0], kb, reads=cap.reads)
        good = meters(t, grams[0])
        t.mixed = t.mixed * 1.5
        bad = meters(t, grams[0])
        res["d"] = float((good["sigma_cov"] - bad["sigma_cov"])[valid].abs().max())
        res["D"] = float((good["D"] - bad["D"])[valid].abs().max())

    ad.run(torch.as_tensor(tokens.astype(np.int64)), select=("attn_probs", "values", "reads"), on_layer=on_layer)
    assert res["d"] > 1e-3 and res["D"] == 0.0


def test_two_shards_merged_equal_one_pass(setup, tmp_path):
    """Acceptance: pass 2 over two shards, merged, equals one pass over both (top-deviation lists included)."""
    mt, model, ad, tracked, st, tokens, doc_ids = setup
    if mt not in ("gpt2", "llama"):
        pytest.skip("two architectures suffice")
    kw = dict(min_count=1, batch_size=4, progress=False, top_k=8)
    whole, meta = DP.deviation_shard(model, ad, tokens, doc_ids, tracked, st, **kw)
    parts = []
    for i, sl in enumerate((slice(0, 5), slice(5, None))):
        s, m = DP.deviation_shard(model, ad, tokens[sl], doc_ids[sl], tracked, st, **kw)
        parts.append(DP.open_partial(DP.save_partial(tmp_path / f"p{i}.zarr", s, m)))
    merged, mmeta = DP.merge_partials(parts)
    for k in ("count", "D_sum", "M_cov_sum", "M_ctx_sum", "z_sum", "zhat_sum", "vbar_tracked_sum", "degenerate"):
        np.testing.assert_allclose(merged[k], whole[k], rtol=1e-9, atol=1e-9, err_msg=k)
    assert int(merged["n_windows"]) == N_WIN == mmeta["n_windows"]
    np.testing.assert_allclose(merged["top_D"], whole["top_D"], rtol=1e-9)
    # the same occurrences (shard 1's windows are offset by 5); ties in D (equal prefixes, equal to the last bits or
    # not: batch shapes change the rounding) may swap places, and at the K-th value either may be kept
    glob = np.where(merged["top_shard"] == 1, merged["top_window"] + 5, merged["top_window"]) * 100 + merged["top_position"]
    ref = whole["top_window"] * 100 + whole["top_position"]
    for l, h in np.ndindex(glob.shape[:2]):
        cut = max(merged["top_D"][l, h, -1], whole["top_D"][l, h, -1]) + 1e-12
        assert set(glob[l, h][merged["top_D"][l, h] > cut]) == set(ref[l, h][whole["top_D"][l, h] > cut])
    # a partial of another revision is refused by name
    s, m = parts[1]
    with pytest.raises(Exception, match="p_other|revision"):
        DP.merge_partials([parts[0], (s, {**m, "revision": "r2"})], names=["p0", "p_other"])


def test_job_folders_merge_in_shard_order_and_a_bad_partial_is_deleted_with_its_folder(setup, tmp_path):
    """deviation.shards_per_job: the partials of runs of shards (one folder per pass-2 job) open in shard order, so
    they merge bit for bit as one partial per job would; a missing partial, or one computed from another shard, is
    refused by name and deleted with its job's folder (a rerun then runs that job again)."""
    import shutil

    mt, model, ad, tracked, st, tokens, doc_ids = setup
    if mt != "gpt2":
        pytest.skip("one architecture suffices")
    kw = dict(min_count=1, batch_size=4, progress=False, top_k=8)
    runs = {"00000": ["00000", "00001"], "00002": ["00002"]}
    cuts = {"00000": slice(0, 3), "00001": slice(3, 5), "00002": slice(5, None)}
    parts = {}
    for i, sl in cuts.items():
        s, m = DP.deviation_shard(model, ad, tokens[sl], doc_ids[sl], tracked, st, **kw)
        parts[i] = (s, {**m, "shard": f"shard-{i}.npz"})
    folders = []
    for first, ids in runs.items():
        folder = tmp_path / "partials" / f"group-{first}"
        for i in ids:
            DP.save_partial(folder / f"shard-{i}.zarr", *parts[i])
        folders.append(str(folder))
    opened, names = DP.open_job_partials(folders[::-1], runs)  # folder order as given does not matter
    assert [Path(n).name for n in names] == ["shard-00000.zarr", "shard-00001.zarr", "shard-00002.zarr"]
    merged, _ = DP.merge_partials(opened, names=names)
    flat = [DP.open_partial(DP.save_partial(tmp_path / "flat" / f"shard-{i}.zarr", *parts[i])) for i in sorted(cuts)]
    want, _ = DP.merge_partials(flat)
    assert sorted(merged) == sorted(want) and all(np.array_equal(merged[k], want[k]) for k in want)
    # a partial of another shard in a partial's place
    bad = Path(folders[0]) / "shard-00001.zarr"
    shutil.rmtree(bad)
    DP.save_partial(bad, *parts["00002"])
    with pytest.raises(StatsError, match=r"shard-00001\.zarr was computed from corpus shard shard-00002\.npz.*deleted it "
                                         r"with its job's folder .*group-00000: rerun to rebuild it"):
        DP.open_job_partials(folders, runs)
    assert not Path(folders[0]).exists() and Path(folders[1]).exists()
    # a missing one
    shutil.rmtree(Path(folders[1]) / "shard-00002.zarr")
    with pytest.raises(StatsError, match=r"shard-00002\.zarr is missing; deleted it with its job's folder"):
        DP.open_job_partials(folders[1:], {"00002": ["00002"]})
    assert not Path(folders[1]).exists()


def test_top_contexts_list_ties_in_corpus_order(setup):
    """A window the corpus repeats gives its contexts the same D, bit for bit: the top-deviation lists (which the
    lenses print) keep such ties in corpus order, earlier window first, where topk leaves their order to the
    device's kernel (the CPU and a GPU listed them differently)."""
    mt, model, ad, tracked, st, tokens, doc_ids = setup
    if mt != "gpt2":
        pytest.skip("one architecture suffices")
    tokens, doc_ids = tokens.copy(), doc_ids.copy()
    for copy in (3, 7):  # window 1 again, in its own batch (3) and in the next one (7)
        tokens[copy], doc_ids[copy] = tokens[1], doc_ids[1]
    sums, _ = DP.deviation_shard(model, ad, tokens, doc_ids, tracked, st, min_count=1, batch_size=4, progress=False,
                                 top_k=48)
    D, idx = sums["top_D"], sums["top_window"] * tokens.shape[1] + sums["top_position"]
    tied = (D[..., 1:] == D[..., :-1]) & np.isfinite(D[..., 1:])
    assert tied.sum() >= 4, "the repeated window gave no ties to order"
    assert (idx[..., 1:] > idx[..., :-1])[tied].all(), "tied contexts out of corpus order"


def test_deviation_store_and_corpus_deviation(setup, tmp_path):
    mt, model, ad, tracked, st, tokens, doc_ids = setup
    if mt != "gpt2":
        pytest.skip("one architecture suffices")
    sums, meta = DP.deviation_shard(model, ad, tokens, doc_ids, tracked, st, min_count=1, batch_size=6, progress=False)
    ds = DP.deviation_dataset(sums, meta, tracked, min_occurrences=3)
    np.testing.assert_allclose(ds["M_cov"] + ds["M_ctx"], ds["D"], atol=1e-9)
    assert np.isfinite(ds["S_bar"]).all() and np.isfinite(ds["S_bar_half"]).all()
    assert ((ds["S_bar"] >= 0) & (ds["S_bar"] <= 2)).all()
    assert ds.attrs["n_types_scored"] >= 2
    path = tmp_path / "deviation.zarr"
    from mfpipe.stats.store import write_store as ws

    ws(ds, path)
    # every array in a data type Zarr v3 specifies: the token strings variable-length UTF-8 (`string`), as the
    # statistics store's, never numpy's fixed-width unicode (`fixed_length_utf32`: no specification; zarr warns)
    types = {json.loads(p.read_text()).get("data_type") for p in path.rglob("zarr.json")} - {None}
    assert types <= {"float32", "float64", "int64", "bool", "string"}, types
    back = DP.open_deviation(path, {"model": "tiny", "revision": "r1"})
    np.testing.assert_allclose(back["S_bar"], ds["S_bar"])
    with pytest.raises(Exception, match="revision"):
        DP.open_deviation(path, {"model": "tiny", "revision": "r9"})


def test_corpus_deviation_is_centred_and_detects_type_dependent_reads():
    """eq:ddec by hand: a head whose mean read is its prediction plus a shared offset scores 0 (centring removes
    the offset); one whose type-dependence is the prediction's reversed scores 2; rare types are left out."""
    rng = np.random.default_rng(0)
    zh = rng.normal(size=(1, 3, 6, 4))
    gram = np.broadcast_to(np.eye(4), (1, 3, 4, 4))
    z = zh.copy()
    z[0, 0] += 5.0  # head 0: prediction + shared offset
    z[0, 1] = -zh[0, 1] + 3.0  # head 1: reversed
    counts = np.array([60, 60, 60, 60, 60, 10])
    S, S_bar = corpus_deviation(z, zh, counts, gram, 50)
    assert abs(S_bar[0, 0]) < 1e-12 and abs(S_bar[0, 1] - 2.0) < 1e-12 and abs(S_bar[0, 2]) < 1e-12
    assert np.isnan(S[0, :, 5]).all()
    # uncentred, the offset would have counted: head 0's plain cosine of each kept type's read and prediction
    x, y = z[0, 0, :5], zh[0, 0, :5]
    plain = 1.0 - (x * y).sum(-1) / np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
    assert plain.mean() > 0.1


def _query_case(mostly_other: bool):
    """Key buckets, query types, a kernel with invalid rows, and attention where key type 0 underflowed (window 0:
    to 0, window 1: tiny) for the query_terms tests."""
    g = torch.Generator().manual_seed(0)
    B, H, T, N, dh = 3, 2, 30, 5, 4
    K = N + 2
    kb = torch.randint(0, K, (B, T), generator=g)
    if mostly_other:
        kb = torch.where(torch.rand(B, T, generator=g) < 0.7, K - 1, kb)
    kb[:, 0] = N  # <bos>
    kb[:2, 1] = 0  # type 0 in the prefix of windows 0 and 1
    qt = torch.where(kb < N, kb, torch.full_like(kb, -1))
    qt[:, 0] = -1
    W = torch.rand(H, N, K, generator=g) + 0.05
    W[:, 3] = torch.nan  # a query type never seen in the statistics half: invalid
    W[1, 4, :] = 0.0  # empty in one head: invalid in all
    logits = torch.randn(B, H, T, T, generator=g).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)
    probs = logits.softmax(-1)
    probs[0] = probs[0].masked_fill(kb[0] == 0, 0.0)  # window 0: type 0's attention underflowed
    probs[1] = torch.where(kb[1] == 0, probs[1] * 1e-34, probs[1])  # window 1: tiny (Â_t / A_t overflows float32)
    values = torch.randn(B, H, T, dh, generator=g)
    mu = torch.randn(H, K, dh, generator=g)
    return kb, qt, W, probs, values, mu, N


QUERY_TERMS = ("z", "zhat", "mixed", "mixed_tracked", "nx", "other", "valid")


@pytest.mark.parametrize("engine", ["torch", "native"])
@pytest.mark.parametrize("block,mostly_other", [(7, False), (256, False), (256, True)])
def test_query_terms_equal_occurrence_terms(block, mostly_other, engine):
    """The fast form pass 2 runs (query_terms: Â per key type, query rows only, causal spans) equals the definition
    (occurrence_terms with pair_kernel's Â) at every query row: validity, N_X, z, ẑ, mixed and the <other> share,
    also where a key type's attention underflowed to 0 or is tiny (the exact per-position formula). The tracked
    keys' mixed term is taken from whichever key set is smaller: both cases (mostly tracked, mostly <other>). Both
    engines of the mixed weights (torch ops; the compiled loop)."""
    kb, qt, W, probs, values, mu, N = _query_case(mostly_other)
    B, H, T, _ = probs.shape
    K = N + 2
    a, nx, valid = pair_kernel(W, kb, qt)
    ref = occurrence_terms(probs, values, a.transpose(0, 1), mu, kb, n_tracked=N)
    plan = query_plan(kb, qt, K, block=block)
    t = query_terms(plan, probs, values, W, mu, n_tracked=N, engine=engine)
    bj = (plan.b, plan.j)
    assert torch.equal(plan.s, qt[bj]) and plan.n == int((qt >= 0).sum())
    assert torch.equal(t.valid, valid[bj]) and t.valid.any() and not t.valid.all()
    v = t.valid
    torch.testing.assert_close(t.nx[v], nx.permute(1, 2, 0)[bj][v], rtol=1e-5, atol=1e-6)
    for name in ("z", "zhat", "mixed", "mixed_tracked"):
        torch.testing.assert_close(getattr(t, name)[v], getattr(ref, name)[bj][v], rtol=1e-5, atol=1e-5, msg=name)
    other = torch.matmul(probs, (kb == K - 1).float()[:, None, :, None]).squeeze(-1).transpose(1, 2)
    torch.testing.assert_close(t.other[v], other[bj][v], rtol=1e-5, atol=1e-7)
    # the underflow cases were exercised: a valid query row after position 1 in windows 0 and 1
    assert all(bool((v & (plan.b == w) & (plan.j > 1)).any()) for w in (0, 1))


@pytest.mark.parametrize("block,mostly_other", [(7, False), (256, True)])
def test_query_terms_native_loop_equals_torch_ops_bit_for_bit(block, mostly_other):
    """The compiled loop of the mixed weights adds the same float32 terms in the same order as the torch ops: every
    term at every valid row is equal bit for bit, the underflow rows included; and a view of some heads of the
    layer's tensors (what each of pass 2's two threads reads) gives those heads' terms unchanged."""
    kb, qt, W, probs, values, mu, N = _query_case(mostly_other)
    plan = query_plan(kb, qt, N + 2, block=block)
    ref = query_terms(plan, probs, values, W, mu, n_tracked=N, engine="torch")
    got = query_terms(plan, probs, values, W, mu, n_tracked=N, engine="native")
    v = ref.valid
    assert torch.equal(got.valid, v)
    for name in QUERY_TERMS:
        assert torch.equal(getattr(got, name)[v], getattr(ref, name)[v]), name
    one = query_terms(plan, probs[:, 1:], values[:, 1:], W[1:], mu[1:], n_tracked=N, engine="native")
    for name in ("zhat", "mixed", "mixed_tracked", "nx", "other"):
        x = getattr(one, name)
        assert torch.equal(x[v], getattr(ref, name)[:, 1:][v]), name


def test_the_compiled_loop_uses_the_thresholds_of_the_torch_ops():
    from mfpipe.deviation import _native_loops, queries
    from mfpipe.meanfield import deviation

    assert _native_loops._UNDERFLOW == np.float32(queries._UNDERFLOW) and _native_loops._TINY == np.float32(deviation.TINY)


def test_pass2_on_two_threads_equals_one_thread_bit_for_bit(setup):
    """Pass 2 with the compiled loop and half the heads on each of two threads (as on a CPU job with two or more
    threads) gives the same sums as the torch ops on one thread, bit for bit, every architecture (rows that are not
    valid in every head dropped alike)."""
    from mfpipe.deviation.pass2 import DeviationAccumulator
    from mfpipe.stats.loop import run_reducer

    mt, model, ad, tracked, st, tokens, doc_ids = setup
    kernel = kernel_from_store(st, tracked, min_count=1)
    grams = layer_grams(ad)
    out = {}
    for engine, threads in (("torch", 1), ("native", 2)):
        def reducer(adapter, n, T, device, engine=engine, threads=threads):
            return DeviationAccumulator(kernel.W, kernel.mu, grams, n, T, window_halves(doc_ids), device,
                                        cpu_threads=threads, engine=engine)

        with torch.no_grad():
            out[engine] = run_reducer(model, ad, tokens, tracked, reducer, batch_size=5, device="cpu", progress=False)
    assert out["torch"]["count"].sum() > 0 and ad.n_heads > 1
    for k in out["torch"]:
        np.testing.assert_array_equal(out["native"][k], out["torch"][k], err_msg=f"{mt}: {k}")


def test_meters_from_gram_products_equal_the_explicit_split():
    """meters() builds every inner product from G z and G ẑ: it equals the explicit e⊥ construction in residual
    units on generic vectors, and flags collinear z, ẑ (D = 0 or 2, and z = ẑ) as degenerate with shares 1/2."""
    g = torch.Generator().manual_seed(3)
    n, H, dh, d = 40, 3, 5, 9
    O = torch.randn(H, dh, d, generator=g, dtype=torch.float64)
    G = O @ O.transpose(1, 2)
    zhat = torch.randn(n, H, dh, generator=g)
    z = zhat + 0.3 * torch.randn(n, H, dh, generator=g)
    mixed = 0.5 * (z + zhat) + 0.2 * torch.randn(n, H, dh, generator=g)
    z[0], z[1], z[2] = 2.0 * zhat[0], -zhat[1], zhat[2]  # collinear: D = 0, D = 2, and e = 0
    from mfpipe.meanfield.deviation import OccurrenceTerms

    m = meters(OccurrenceTerms(z, zhat, mixed, None), G)
    for i in range(n):
        for h in range(H):
            zr, hr, xr = (x[i, h].double() @ O[h] for x in (z, zhat, mixed))
            D = 1 - zr @ hr / torch.sqrt((zr @ zr) * (hr @ hr))
            assert abs(float(m["D"][i, h] - D)) < 1e-12
            if i < 3:
                assert bool(m["degenerate"][i, h]) and float(m["sigma_cov"][i, h]) == 0.5
                continue
            e = zr - hr
            ep = e - (e @ hr) / (hr @ hr) * hr
            assert not bool(m["degenerate"][i, h])
            assert abs(float(m["sigma_cov"][i, h] - (zr - xr) @ ep / (ep @ ep))) < 1e-9
            assert abs(float(m["sigma_ctx"][i, h] - (xr - hr) @ ep / (ep @ ep))) < 1e-9
    assert abs(float(m["D"][0].max())) < 1e-12 and abs(float(m["D"][1].min()) - 2.0) < 1e-12


def test_a_deviation_store_is_checked_against_the_statistics_half_it_was_computed_over():
    """The lenses index the store's top contexts by (shard, window) of the statistics half: a half with fewer shards or
    windows than the store was computed over, or another context length, is refused with advice; missing counts pass."""
    import re

    import xarray as xr

    from mfpipe.deviation.store import check_against_half
    from mfpipe.stats.api import ProvenanceError

    ds = xr.Dataset(attrs={"n_partials": 2, "n_windows": 12, "context_length": 16})
    info = {"context_length": 16, "halves": {"stats": {"n_windows": 12}}}
    check_against_half(ds, "dev.zarr", Path("shards"), ["a", "b", "c"], info)
    check_against_half(xr.Dataset(), "dev.zarr", Path("shards"), [], {"context_length": 16})
    with pytest.raises(ProvenanceError, match=re.escape("deviation store dev.zarr was computed over 2 shards of the "
                                                        "statistics half, shards has 1: rerun the deviation stage")):
        check_against_half(ds, "dev.zarr", Path("shards"), ["a"], info)
    with pytest.raises(ProvenanceError, match=re.escape("computed over 12 windows of the statistics half, shards has 6")):
        check_against_half(ds, "dev.zarr", Path("shards"), ["a", "b"], {**info, "halves": {"stats": {"n_windows": 6}}})
    with pytest.raises(ProvenanceError, match=re.escape("deviation store dev.zarr has context length 16, the corpus 32: "
                                                        "rerun the deviation stage for this corpus")):
        check_against_half(ds, "dev.zarr", Path("shards"), ["a", "b"], {**info, "context_length": 32})
