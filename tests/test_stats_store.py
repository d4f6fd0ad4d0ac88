"""Statistics store: layout, NaN fill of unwritten chunks, provenance refusal, atomic writes, partials, and
resuming an interrupted (killed) stats run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from stats_reference import BOS, tracked_for, zipf_windows
from tiny_models import make_tiny_model

from mfpipe.corpus.windows import Shard, write_shards
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import (
    ProvenanceError,
    accumulate_shard,
    finalize,
    load_partial,
    merge_sums,
    open_stats,
    partial_meta,
    save_partial,
    write_store,
)

TESTS = Path(__file__).resolve().parent
META = {"model": "tiny-gpt2", "revision": "step100", "half": "stats", "corpus_fingerprint": "abc123"}


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("gpt2", seed=11)
    tokens = zipf_windows(8, seed=4)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(model, get_adapter(model), tokens, tracked, batch_size=4, device="cpu", progress=False)
    return model, tokens, tracked, sums


@pytest.fixture()
def store(tiny, tmp_path):
    _, _, tracked, sums = tiny
    ds = finalize(sums, tracked, META)
    path = write_store(ds, tmp_path / "stats" / "tiny-gpt2" / "step100" / "stats.zarr")
    return ds, path, tracked


def test_store_layout_and_roundtrip(store, tiny):
    ds, path, tracked = store
    model = tiny[0]
    st = open_stats(path)
    N, L = tracked.n, model.config.n_layer
    assert st.ds["P"].dims == ("layer", "head", "query", "key")
    assert st.ds.sizes["key"] == N + 2 and st.ds.sizes["depth"] == L + 1
    assert list(st.ds["key_str"].values[-2:]) == ["<bos>", "<other>"]
    assert list(st.ds["query_str"].values) == tracked.strings
    assert int(st.ds["key_token_id"].values[N]) == BOS
    # one layer per chunk, NaN fill
    for name in ("P", "mu", "zbar", "centroid", "resid_var", "mlp_out_mean"):
        arr = zarr.open_array(str(path / name), mode="r")
        assert arr.chunks[0] == 1 and arr.chunks[1:] == arr.shape[1:], name
        assert np.isnan(arr.fill_value), name
    for k in ("model", "revision", "half", "corpus_fingerprint", "tracked_fingerprint", "n_tracked", "context_length",
              "n_tokens", "n_windows", "mfpipe_version"):
        assert k in st.attrs, k
    assert st.attrs["tracked_fingerprint"] == tracked.fingerprint
    assert st.attrs["n_tokens"] == tiny[1].size
    xr.testing.assert_identical(st.ds.load(), ds)
    with warnings.catch_warnings():  # what a researcher types opens it quietly, with its coords
        warnings.simplefilter("error")
        plain = xr.open_zarr(path)
    assert plain.attrs["model"] == st.attrs["model"] and "key_str" in plain.coords
    # accessors
    P1 = st.P(layer=1)
    assert P1.dims == ("head", "query", "key")
    np.testing.assert_allclose(P1.sum("key").values, 1.0, atol=1e-5)
    assert st.centroids().dims == ("depth", "query", "dim")
    assert st.bos().dims == ("depth", "dim")
    ad = get_adapter(model)
    mu_r = st.mu(layer=0, out_proj_slices=ad.out_proj_slices)
    want = np.einsum("hkd,hde->hke", ds["mu"].isel(layer=0).values, ad.out_proj_slices(0).numpy())
    np.testing.assert_allclose(mu_r.values, want, rtol=1e-5, atol=1e-6)
    z_all = st.zbar(out_proj_slices=ad)  # the adapter itself is accepted
    assert z_all.dims == ("layer", "head", "query", "dim")
    np.testing.assert_allclose(
        z_all.isel(layer=1).values,
        np.einsum("hsd,hde->hse", ds["zbar"].isel(layer=1, key=slice(0, tracked.n)).values, ad.out_proj_slices(1).numpy()),
        rtol=1e-5, atol=1e-6,
    )
    W = st.W()
    assert W.dims == P1.dims[:0] + ("layer", "head", "query", "key")
    C = st.context_count().values
    assert (W.values[..., C < 20] == 0).all()


def test_unwritten_chunks_read_as_nan(store):
    ds, path, _ = store
    # a chunk that was never written (here: removed) must read as NaN, never as 0
    for name in ("P", "centroid", "mu"):
        chunk = path / name / "c" / "1"
        assert chunk.exists(), name
        import shutil

        shutil.rmtree(chunk)
    st = open_stats(path)
    assert np.isnan(st.P(layer=1).values).all()
    np.testing.assert_array_equal(st.P(layer=0).values, ds["P"].isel(layer=0).values)
    assert np.isnan(st.ds["centroid"].isel(depth=1).values).all()
    assert np.isnan(st.mu(layer=1).values).all()
    assert np.isfinite(st.ds["centroid"].isel(depth=0).values).all()


def test_provenance_refusal(store):
    _, path, tracked = store
    open_stats(path, expect={"model": "tiny-gpt2", "revision": "step100", "N": tracked.n,
                             "tracked_fingerprint": tracked.fingerprint, "context_length": 16})
    with pytest.raises(ProvenanceError) as e:
        open_stats(path, expect={"model": "tiny-gpt2", "revision": "step200"})
    msg = str(e.value)
    assert "revision" in msg and "step200" in msg and "step100" in msg and "rerun" in msg
    with pytest.raises(ProvenanceError, match="n_tracked"):
        open_stats(path, expect={"N": tracked.n + 1})
    with pytest.raises(ProvenanceError, match="corpus_fingerprint"):
        open_stats(path, expect={"corpus_fingerprint": "zzz"})
    with pytest.raises(ProvenanceError, match="no 'tokenizer'"):
        open_stats(path, expect={"tokenizer": "gpt2"})
    with pytest.raises(FileNotFoundError):
        open_stats(path.parent / "eval.zarr")


def test_interrupted_write_leaves_no_store(tiny, tmp_path, monkeypatch):
    _, _, tracked, sums = tiny
    ds = finalize(sums, tracked, META)
    path = tmp_path / "s.zarr"
    real = xr.Dataset.to_zarr

    def broken(self, store, *a, **k):
        real(self.drop_vars(["P"]), store, *a, **{**k, "encoding": {n: e for n, e in k["encoding"].items() if n != "P"}})
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(xr.Dataset, "to_zarr", broken)
    with pytest.raises(KeyboardInterrupt):
        write_store(ds, path)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone too
    monkeypatch.setattr(xr.Dataset, "to_zarr", real)
    write_store(ds, path)
    old = open_stats(path).ds.load()
    # a failed rewrite keeps the previous complete store
    monkeypatch.setattr(xr.Dataset, "to_zarr", broken)
    with pytest.raises(KeyboardInterrupt):
        write_store(ds, path)
    xr.testing.assert_identical(open_stats(path).ds.load(), old)


def test_partial_roundtrip_and_atomic_save(tiny, tmp_path, monkeypatch):
    from mfpipe.stats.partials import STORED_DTYPES, partial_size

    _, tokens, tracked, sums = tiny
    p = tmp_path / "part.zarr"
    save_partial(p, sums, partial_meta(tracked, tokens, {"shard": "x"}))
    back, meta = load_partial(p)
    assert meta["shard"] == "x" and meta["n_windows"] == tokens.shape[0]
    assert partial_size(p) > 0
    for k, v in sums.items():
        assert back[k].shape == v.shape, k
        if k == "resid_mid_sum":  # not stored: rebuilt from resid_sum + attn_out_sum (float32-stored)
            np.testing.assert_allclose(back[k], v, rtol=1e-6, atol=1e-6 * np.abs(v).max(), err_msg=k)
            continue
        assert back[k].dtype == STORED_DTYPES[k], k
        # exact where the dtype is kept, one float32 rounding otherwise
        assert np.array_equal(back[k], np.asarray(v).astype(STORED_DTYPES[k]), equal_nan=True), k
    # xarray opens a partial (dimension names on every array)
    ds = xr.open_zarr(p, consolidated=False)
    assert ds["P_sum"].dims == ("layer", "head", "query", "key")

    # an interrupted write leaves nothing (no folder, no temporary)
    import zarr as zarr_mod

    real = zarr_mod.Array.__setitem__
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(self, *a, **k)

    monkeypatch.setattr(zarr_mod.Array, "__setitem__", flaky)
    q = tmp_path / "part2.zarr"
    with pytest.raises(OSError):
        save_partial(q, sums)
    assert not q.exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["part.zarr"]


def test_partial_written_in_runs_of_chunks_is_the_same_partial(tiny, tmp_path, monkeypatch):
    """save_partial writes runs of chunks per Zarr call up to WRITE_BLOCK_BYTES: any run length (one chunk per
    call, a partial run at the end, a whole layer) gives the same stored values, and the runs cover every chunk
    of every sum exactly once."""
    from mfpipe.stats import partials
    from mfpipe.stats.partials import _chunks, _write_blocks

    _, tokens, tracked, sums = tiny
    L, H, N, K = sums["P_sum"].shape
    assert H >= 3
    ref = tmp_path / "whole.zarr"
    save_partial(ref, sums, mantissa_bits=11)
    want, _ = load_partial(ref)
    for run in (1, 2, H):  # heads of the kernel per call (2: a shorter run at the end when H is odd)
        monkeypatch.setattr(partials, "WRITE_BLOCK_BYTES", run * N * K * 4)
        blocks = _write_blocks(sums["P_sum"].shape, 2, 4)
        assert all(b[1].stop - b[1].start <= run for b in blocks) and len(blocks) == L * -(-H // run)
        q = tmp_path / f"run{run}.zarr"
        save_partial(q, sums, mantissa_bits=11)
        got, _ = load_partial(q)
        for k in want:
            assert np.array_equal(got[k], want[k], equal_nan=True), (run, k)
    for key, v in sums.items():  # every element of every sum in exactly one block
        shape = np.shape(v)
        chunks = _chunks(key, shape) if len(shape) else ()
        n_lead = next((i for i, c in enumerate(chunks) if c != 1), len(chunks))
        hits = np.zeros(shape, dtype=np.int64)
        for idx in _write_blocks(shape, n_lead, 8):
            hits[idx] += 1
        assert (hits == 1).all(), key


def test_derived_sums_made_a_layer_at_a_time_write_the_same_partial(tiny, tmp_path, monkeypatch):
    """The statistics job's reducer hands out its derived sums (attn_out, mlp_out, values, resid_mid of a float32
    GPT-2) as LayerDerived, computed a layer (or a block of layers) at a time as save_partial writes them: equal bit
    for bit to the eager sums, whole, by layer and by block, and the partial written from them is the eager one's at
    any block length (one layer per block, all at once)."""
    from functools import partial

    from mfpipe.stats import partials
    from mfpipe.stats.layered import LayerDerived
    from mfpipe.stats.shards import pass1_reducer

    model, tokens, tracked, eager = tiny
    lazy = accumulate_shard(model, get_adapter(model), tokens, tracked, batch_size=4, device="cpu", progress=False,
                            reducer=partial(pass1_reducer, lazy_derived=True))
    derived = {k for k, v in lazy.items() if isinstance(v, LayerDerived)}
    assert derived == {"attn_out_sum", "mlp_out_sum", "value_sum", "resid_mid_sum"}
    L = eager["P_sum"].shape[0]
    assert L >= 2
    for key in derived:
        assert np.array_equal(np.asarray(lazy[key]), eager[key]), key
        assert np.array_equal(lazy[key][L - 1], eager[key][L - 1]), key
        assert np.array_equal(lazy[key][1:, ..., :2], eager[key][1:, ..., :2]), key
    ref = tmp_path / "eager.zarr"
    save_partial(ref, eager, mantissa_bits=11)
    want, _ = load_partial(ref)
    K, d = eager["resid_sum"].shape[1:]
    for layers in (1, L):
        monkeypatch.setattr(partials, "WRITE_BLOCK_BYTES", layers * K * d * 4)
        q = tmp_path / f"lazy{layers}.zarr"
        save_partial(q, lazy, mantissa_bits=11)
        got, _ = load_partial(q)
        for k in want:
            assert np.array_equal(got[k], want[k], equal_nan=True), (layers, k)


def test_kernel_sums_mapped_from_disk_are_the_same_and_leave_nothing(tiny, tmp_path):
    """stats.kernel_sums: disk: the kernel sums in a file mapped from the partials' folder and unlinked at once give
    the same partial bit for bit, and the folder holds nothing but the partial after (nor while the job runs)."""
    from functools import partial

    from mfpipe.stats.shards import pass1_reducer

    model, tokens, tracked, eager = tiny
    seen = []

    def reducer(*a):
        acc = pass1_reducer(*a, lazy_derived=True, kernel_dir=str(tmp_path))
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        return acc

    mapped = accumulate_shard(model, get_adapter(model), tokens, tracked, batch_size=4, device="cpu", progress=False,
                              reducer=reducer)
    mapped_from = _mapped_from(mapped["P_sum"])
    assert seen == [[]] and ".kernel-sums-" in mapped_from and mapped_from.endswith("(deleted)"), mapped_from
    assert np.array_equal(mapped["P_sum"], eager["P_sum"])
    save_partial(tmp_path / "mapped.zarr", mapped, mantissa_bits=11)
    save_partial(tmp_path / "eager.zarr", eager, mantissa_bits=11)
    got, want = load_partial(tmp_path / "mapped.zarr")[0], load_partial(tmp_path / "eager.zarr")[0]
    assert all(np.array_equal(got[k], want[k], equal_nan=True) for k in want)
    del mapped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eager.zarr", "mapped.zarr"]
    with pytest.raises(Exception, match="stats.kernel_sums: memory"):
        partial(pass1_reducer, kernel_dir=str(tmp_path))(get_adapter(model), tracked.n, tokens.shape[1], "meta")


def _mapped_from(a: np.ndarray) -> str:
    """The file the array's memory is mapped from (Linux's /proc/self/maps; "" where it is none)."""
    addr = a.__array_interface__["data"][0]
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return rest[-1] if len(rest) == 5 else ""
    return ""


def test_round_mantissa_is_numcodecs_bitround_with_its_bound():
    """round_mantissa (the rounding of partials at stats.partial_mantissa_bits) against numcodecs' BitRound, an
    independent implementation of round-to-nearest-even on the mantissa: bit for bit on finite values; each value
    within 2^-(bits+1) of itself; ties to even; 0, inf and NaN kept; idempotent; all bits = an exact copy."""
    from numcodecs import BitRound

    from mfpipe.stats.partials import round_mantissa

    rng = np.random.default_rng(3)
    for dt, full in ((np.float32, 23), (np.float64, 52)):
        a = (rng.standard_normal(20_000) * np.exp(rng.normal(0, 8, 20_000))).astype(dt)
        for bits in (1, 5, 11, full - 1, full):
            r = round_mantissa(a, bits)
            assert r.dtype == dt and r.shape == a.shape and r is not a
            assert np.array_equal(r, BitRound(bits).decode(BitRound(bits).encode(a)).reshape(a.shape)), (dt, bits)
            rel = np.abs(r.astype(np.float64) - a) / np.abs(a.astype(np.float64))
            assert rel.max() <= 2.0 ** -(bits + 1), (dt, bits, rel.max())
            if bits < full - 4:
                assert rel.max() > 2.0 ** -(bits + 2), (dt, bits)  # it did round
            assert np.array_equal(round_mantissa(r, bits), r)
        assert np.array_equal(round_mantissa(a, full), a)
    # ties to even: 1 + 2^-12 and 1 + 3 * 2^-12 lie half-way between 11-bit neighbours
    one = np.float32(1.0)
    ties = np.array([one + 2.0 ** -12, one + 3 * 2.0 ** -12, -(one + 2.0 ** -12)], dtype=np.float32)
    assert round_mantissa(ties, 11).tolist() == [1.0, 1.0 + 2.0 ** -10, -1.0]
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.0], dtype=np.float32)
    out = round_mantissa(special, 3)
    assert np.array_equal(out, special, equal_nan=True) and np.signbit(out[1])
    with pytest.raises(ValueError, match="bits=24 is outside 1..23"):
        round_mantissa(special, 24)


def test_rounded_partial_is_smaller_within_its_bound_and_says_so(tiny, tmp_path):
    """save_partial(mantissa_bits=k): the float sums stored within 2^-(k+1) of the exact float32 / float64 ones
    (the residual sums at k + 24 bits), counts exact, ``meta["mantissa_bits"]`` = k; the partial is smaller; a
    k outside 1..23 is refused naming the config key."""
    from mfpipe.stats import StatsError
    from mfpipe.stats.partials import DERIVED_KEYS, INT_KEYS, RESIDUAL_EXTRA_BITS, STORED_DTYPES, partial_size

    _, tokens, tracked, sums = tiny
    exact, rounded = tmp_path / "exact.zarr", tmp_path / "rounded.zarr"
    save_partial(exact, sums, partial_meta(tracked, tokens))
    save_partial(rounded, sums, partial_meta(tracked, tokens), mantissa_bits=7)
    a, meta_a = load_partial(exact)
    b, meta_b = load_partial(rounded)
    assert meta_a["mantissa_bits"] is None and meta_b["mantissa_bits"] == 7
    assert partial_size(rounded) < 0.8 * partial_size(exact), (partial_size(rounded), partial_size(exact))
    for key in a:
        if key in INT_KEYS:
            assert np.array_equal(a[key], b[key]), key
            continue
        if key in DERIVED_KEYS:
            continue
        bits = 7 + (RESIDUAL_EXTRA_BITS if STORED_DTYPES[key] == np.float64 else 0)
        x, y = a[key].astype(np.float64), b[key].astype(np.float64)
        assert np.array_equal(np.isnan(x), np.isnan(y)), key
        ok = ~np.isnan(x) & (x != 0)
        assert np.array_equal(y[x == 0], x[x == 0]), key
        if ok.any():
            rel = np.abs(y[ok] - x[ok]) / np.abs(x[ok])
            assert rel.max() <= 2.0 ** -(bits + 1), (key, rel.max())
            if STORED_DTYPES[key] == np.float32:  # (a float64 sum of few float32 terms may fit in 31 bits)
                assert rel.max() > 0, key  # it was rounded
    with pytest.raises(StatsError, match=r"mantissa_bits=24 is outside 1\.\.23.*stats\.partial_mantissa_bits"):
        save_partial(tmp_path / "bad.zarr", sums, mantissa_bits=24)
    assert not (tmp_path / "bad.zarr").exists()


def test_partial_checks_before_merge(tiny, tmp_path):
    """A partial of other shapes or other provenance is refused, naming the file and what to do."""
    from mfpipe.stats import StatsError
    from mfpipe.stats.partials import check_partial

    _, tokens, tracked, sums = tiny
    p = tmp_path / "a.zarr"
    save_partial(p, sums, partial_meta(tracked, tokens, {"model": "m1"}))
    back, meta = load_partial(p)
    check_partial(str(p), back, meta, expect={"model": "m1", "tracked_fingerprint": tracked.fingerprint})
    with pytest.raises(StatsError, match=r"a\.zarr was computed for model='m1'.*rerun"):
        check_partial(str(p), back, meta, expect={"model": "m2"})
    other = dict(sums, P_sum=sums["P_sum"][:, :, :, :-1])
    with pytest.raises(StatsError, match=r"partial b\.zarr: P_sum has shape .*rerun"):
        merge_sums([sums, other], names=["a.zarr", "b.zarr"])
    with pytest.raises(StatsError, match=r"holds 8 windows, its shard has 9"):
        check_partial(str(p), back, dict(meta, n_windows=9))
    (p / "P_sum" / "zarr.json").write_text("{not json")
    with pytest.raises(StatsError, match=r"a\.zarr is unreadable.*delete it and rerun"):
        load_partial(p)
    with pytest.raises(FileNotFoundError, match="rerun the stats_shard step"):
        load_partial(tmp_path / "missing.zarr")


def test_layerwise_merge_writes_the_same_store(tiny, tmp_path):
    """The merge of the workflow (partials opened with P on disk, summed and written one layer at a time by
    write_stats) writes the store finalize + write_store writes from the in-memory merge, file for file."""
    from mfpipe.stats.layered import LayerSum
    from mfpipe.stats.partials import open_partial
    from mfpipe.stats.store import write_stats

    model, tokens, tracked, _ = tiny
    adapter = get_adapter(model)
    paths = []
    for i, chunk in enumerate((tokens[:3], tokens[3:])):
        sums = accumulate_shard(model, adapter, chunk, tracked, batch_size=2, device="cpu", progress=False)
        paths.append(save_partial(tmp_path / f"shard-{i}.zarr", sums, partial_meta(tracked, chunk)))
    eager = merge_sums([load_partial(p)[0] for p in paths])
    lazy = merge_sums([open_partial(p)[0] for p in paths])
    assert isinstance(lazy["P_sum"], LayerSum) and lazy["P_sum"].shape == eager["P_sum"].shape
    assert np.array_equal(np.asarray(lazy["P_sum"]), eager["P_sum"])
    a = write_store(finalize(eager, tracked, META), tmp_path / "a.zarr")
    b = tmp_path / "b.zarr"
    write_stats(lazy, tracked, META, b)
    files = lambda root: {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}  # noqa: E731
    fa, fb = files(a), files(b)
    assert sorted(fa) == sorted(fb)
    assert [k for k in fa if fa[k] != fb[k]] == []
    xr.testing.assert_identical(open_stats(b).ds.load(), open_stats(a).ds.load())
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]


def test_a_damaged_chunk_of_a_partial_is_an_error_naming_it(tiny, tmp_path):
    """Every chunk of a partial is written and checksummed: a truncated, altered or deleted chunk file is an error
    naming the partial (when its P layer is merged, for a P chunk), never a silent zero."""
    from mfpipe.stats.errors import PartialError
    from mfpipe.stats.partials import open_partial
    from mfpipe.stats.store import write_stats

    _, tokens, tracked, sums = tiny
    p = save_partial(tmp_path / "good.zarr", sums)
    chunk = p / "P_sum" / "c" / "1" / "0" / "0" / "0"
    other = p / "resid_sum" / "c" / "0" / "0" / "0"
    assert chunk.is_file() and other.is_file()
    cases = {"truncated": lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
             "flipped": lambda f: f.write_bytes(f.read_bytes()[:-9] + bytes([f.read_bytes()[-9] ^ 1]) + f.read_bytes()[-8:]),
             "deleted": lambda f: f.unlink()}
    for name, damage in cases.items():
        for target in (chunk, other):
            q = tmp_path / f"{name}.zarr"
            import shutil

            shutil.rmtree(q, ignore_errors=True)
            shutil.copytree(p, q)
            damage(q / target.relative_to(p))
            with pytest.raises(PartialError, match=rf"{name}\.zarr is unreadable.*rerun") as err:
                merged = merge_sums([open_partial(q)[0]])
                write_stats(merged, tracked, META, tmp_path / "s.zarr")
            assert err.value.path == str(q), (name, target)
            assert not (tmp_path / "s.zarr").exists()


# ------------------------------------------------------------------------------- interrupted stats run
class CountingAdapter:
    """Delegates to a real adapter; records which shard (by first token row) is computed, and can fail."""

    def __init__(self, inner, fail_at_call: int | None = None, hard_kill: bool = False):
        self.inner = inner
        self.calls = 0
        self.fail_at_call = fail_at_call
        self.hard_kill = hard_kill
        self.seen = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, ids, select="all", on_layer=None, on_final=None, **kw):
        # the shard loop's one forward per batch (mfpipe.stats.shards.accumulate_shard calls the adapter's site)
        self.calls += 1
        self.seen.append(ids[:, 1].tolist())

        def layer(cap):
            on_layer(cap)
            if self.fail_at_call is not None and self.calls == self.fail_at_call and cap.layer == 0:
                if self.hard_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure mid-shard")

        return self.inner.run(ids, select=select, on_layer=layer, on_final=on_final, **kw)


def _shards(tmp_path, n_shards=4, per=3):
    tokens = zipf_windows(n_shards * per, seed=9)
    doc = np.zeros_like(tokens)
    doc[:, 0] = -1
    paths = write_shards(Shard(tokens, doc), tmp_path / "corpus" / "stats", per)
    return tokens, paths


def _merge_to_store(partials, tracked, path):
    sums = merge_sums([load_partial(p)[0] for p in partials])
    return write_store(finalize(sums, tracked, META), path)


def shard_partials(model, adapter, shards, partials, tracked) -> list[Path]:
    """What the workflow does per shard (Snakemake reruns exactly the stats_shard jobs whose partial is
    missing; each job runs mfpipe.stats.jobs.stats_shard): one shard's sums -> one partial, written
    atomically. Returns the partials computed."""
    from mfpipe.corpus.windows import read_shard

    done = []
    for sp, pp in zip(shards, partials):
        if Path(pp).exists():
            continue
        tokens = read_shard(sp).tokens
        sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=2, device="cpu", progress=False)
        save_partial(pp, sums, partial_meta(tracked, tokens, {"shard": str(sp)}))
        done.append(Path(pp))
    return done


@pytest.mark.parametrize("hard_kill", [False, True], ids=["exception", "sigkill"])
def test_interrupted_run_resumes_missing_shards_only(tmp_path, hard_kill):
    tokens, shards = _shards(tmp_path)
    tracked = tracked_for(tokens)
    tracked.save(tmp_path / "tracked.json")
    model = make_tiny_model("gpt2", seed=2)
    partials = [tmp_path / "partials" / (p.stem + ".zarr") for p in shards]
    # batch_size 2: each 3-window shard takes 2 forwards; call 6 is the 2nd batch of shard 2 (mid-shard)
    if hard_kill:
        script = textwrap.dedent(
            f"""
            import sys; sys.path.insert(0, {str(TESTS)!r})
            from tiny_models import make_tiny_model
            from mfpipe.models.adapters import get_adapter
            from mfpipe.corpus.tracked import TrackedSet
            from test_stats_store import CountingAdapter, shard_partials
            model = make_tiny_model("gpt2", seed=2)
            ad = CountingAdapter(get_adapter(model), fail_at_call=6, hard_kill=True)
            shard_partials(model, ad, {[str(p) for p in shards]!r}, {[str(p) for p in partials]!r},
                           TrackedSet.load({str(tmp_path / 'tracked.json')!r}))
            """
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    else:
        ad = CountingAdapter(get_adapter(model), fail_at_call=6)
        with pytest.raises(RuntimeError, match="injected"):
            shard_partials(model, ad, shards, partials, tracked)
    assert [p.exists() for p in partials] == [True, True, False, False]
    # nothing half-written: no temporary or partial file of the interrupted shard is left
    assert sorted(x.name for x in (tmp_path / "partials").iterdir()) == [partials[0].name, partials[1].name]

    ad = CountingAdapter(get_adapter(model))
    done = shard_partials(model, ad, shards, partials, tracked)
    assert done == partials[2:]  # only the missing shards are recomputed
    assert ad.calls == 4
    resumed = _merge_to_store(partials, tracked, tmp_path / "resumed.zarr")

    clean_partials = [tmp_path / "clean" / p.name for p in partials]
    shard_partials(model, get_adapter(model), shards, clean_partials, tracked)
    clean = _merge_to_store(clean_partials, tracked, tmp_path / "clean.zarr")
    xr.testing.assert_identical(open_stats(resumed).ds.load(), open_stats(clean).ds.load())
    assert load_partial(partials[0])[1]["n_windows"] == 3
