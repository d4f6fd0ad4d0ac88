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
from test_stats_reference import BOS, tracked_for, zipf_windows
from tiny_models import make_tiny_model

from mfpipe.corpus import Shard, write_shards
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
    _, _, _, sums = tiny
    for compress in (False, True):
        p = tmp_path / "part.npz"
        save_partial(p, sums, {"shard": "x"}, compress=compress)
        back, meta = load_partial(p)
        assert meta["shard"] == "x"
        for k, v in sums.items():
            assert back[k].dtype == v.dtype and np.array_equal(back[k], v, equal_nan=True), k
    from numpy.lib import format as npformat

    calls = {"n": 0}
    real = npformat.write_array

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(npformat, "write_array", flaky)
    q = tmp_path / "part2.npz"
    with pytest.raises(OSError):
        save_partial(q, sums)
    assert not q.exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["part.npz"]


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

    def capture(self, ids, on_layer, on_final=None):
        self.calls += 1
        self.seen.append(ids[:, 1].tolist())

        def layer(cap):
            on_layer(cap)
            if self.fail_at_call is not None and self.calls == self.fail_at_call and cap.layer == 0:
                if self.hard_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure mid-shard")

        self.inner.capture(ids, layer, on_final)


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
    missing; each job runs workflow/scripts/stats_shard.py): one shard's sums -> one partial, written
    atomically. Returns the partials computed."""
    from mfpipe.corpus import read_shard

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
    partials = [tmp_path / "partials" / (p.stem + ".npz") for p in shards]
    # batch_size 2: each 3-window shard takes 2 forwards; call 6 is the 2nd batch of shard 2 (mid-shard)
    if hard_kill:
        script = textwrap.dedent(
            f"""
            import sys; sys.path.insert(0, {str(TESTS)!r})
            from tiny_models import make_tiny_model
            from mfpipe.models.adapters import get_adapter
            from mfpipe.tracked import TrackedSet
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
