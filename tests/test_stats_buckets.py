"""Key buckets and the per-position prefix counts n_t(X_j), in their two forms, against a brute-force loop;
and the read side of the statistics stage without torch."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from stats_reference import BOS, tracked_for, zipf_windows

from mfpipe.stats.buckets import causal_pairs, n_pairs, prefix_counts, window_buckets


def brute_counts(kb: np.ndarray, K: int) -> np.ndarray:
    B, T = kb.shape
    out = np.zeros((B, T, K), dtype=np.int64)
    for b in range(B):
        for j in range(T):
            for k in range(j + 1):
                out[b, j, kb[b, k]] += 1
    return out


def buckets(seed=0, n_windows=5, T=19):
    tokens = zipf_windows(n_windows, T=T, seed=seed)
    tracked = tracked_for(tokens)
    kb, qt = window_buckets(tokens, tracked.key_bucket_lut(), tracked.query_bucket_lut(), tracked.n)
    return tokens, tracked, kb, qt


def test_window_buckets_follow_the_conventions():
    tokens, tracked, kb, qt = buckets()
    N = tracked.n
    assert (kb[:, 0] == N).all() and (qt[:, 0] == -1).all()  # position 0: <bos>, never a query
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}
    for b, j in np.ndindex(tokens.shape):
        if j == 0:
            continue
        t = int(tokens[b, j])
        assert kb[b, j] == rank.get(t, N + 1)  # BOS id at j >= 1 lands in <other>
        assert qt[b, j] == rank.get(t, -1)
    assert BOS not in rank


def test_prefix_counts_equal_a_brute_force_loop():
    _, tracked, kb, _ = buckets(seed=3)
    K = tracked.n + 2
    got = prefix_counts(torch.as_tensor(kb), K).numpy()
    np.testing.assert_array_equal(got, brute_counts(kb, K))
    assert got.dtype == np.int32


def test_causal_pairs_are_the_prefix_counts_at_each_query():
    _, tracked, kb, qt = buckets(seed=5)
    K = tracked.n + 2
    dense = brute_counts(kb, K)
    for chunk in (None, 7, 1000):
        counts = {}
        for bb, jj, kk in causal_pairs(torch.as_tensor(qt), chunk=chunk):
            for b, j, k in zip(bb.tolist(), jj.tolist(), kk.tolist()):
                assert k <= j and qt[b, j] >= 0
                counts.setdefault((b, j), np.zeros(K, dtype=np.int64))[kb[b, k]] += 1
        queries = {(int(b), int(j)) for b, j in zip(*np.nonzero(qt >= 0))}
        assert set(counts) == queries
        for (b, j), c in counts.items():
            np.testing.assert_array_equal(c, dense[b, j])
    assert n_pairs(torch.as_tensor(qt)) == sum(j + 1 for _, j in queries)


@pytest.mark.parametrize("rank_table", [None, 1])
@pytest.mark.parametrize("pair_chunk", [None, 50])
def test_native_kernel_plan_is_the_causal_pairs_with_their_compact_cells(monkeypatch, pair_chunk, rank_table):
    """The native engine's plan (mfpipe.stats.native.plan_batch): per group of windows, the pairs of causal_pairs in
    its order, each pair's compact cell naming its (query type, key bucket) cell, the group's cells distinct, their
    pair counts the batch's nbar; through the batch's small rank table and through the cell-indexed one."""
    import mfpipe.stats.pass1 as pass1
    from mfpipe.stats import native

    if not native.available():
        pytest.skip("numba is not installed")
    if pair_chunk is not None:
        monkeypatch.setattr(pass1, "PAIR_CHUNK", pair_chunk)  # groups of one window
    if rank_table is not None:
        monkeypatch.setattr(pass1, "RANK_TABLE_MAX", rank_table)  # too small: the [N*K] table
    _, tracked, kb, qt = buckets(seed=3, n_windows=6, T=17)
    N, K, T = tracked.n, tracked.n + 2, kb.shape[1]
    acc = pass1.Accumulator(1, 3, 1, 1, N, T, engine="native")
    acc.begin_batch(kb, qt)
    pl = acc._plan.pairs
    got_cell = []
    for c in range(len(pl.m_off) - 1):
        cells = pl.cells[pl.u_off[c] : pl.u_off[c + 1]]
        assert len(np.unique(cells)) == len(cells)
        got_cell.append(cells[pl.pinv[pl.m_off[c] : pl.m_off[c + 1]]])
    assert len(got_cell) == (6 if pair_chunk else 1)
    bb, jj, kk = next(causal_pairs(torch.as_tensor(qt), chunk=None))
    cell = torch.as_tensor(qt)[bb, jj] * K + torch.as_tensor(kb)[bb, kk]
    np.testing.assert_array_equal(np.concatenate(got_cell), cell)
    # nbar's batch part waits in the plan's cell counts, to go in with the kernel sums (end_batch) or, for a batch
    # that never ends, at the next plan or at sums()
    waiting = np.zeros(N * K, dtype=np.int64)
    np.add.at(waiting, pl.cells, pl.cell_counts[:, 0])
    np.testing.assert_array_equal(waiting, np.bincount(cell.numpy(), minlength=N * K))
    np.testing.assert_array_equal(acc.sums()["nbar_sum"].reshape(-1), np.bincount(cell.numpy(), minlength=N * K))
    eng = acc._engine  # the tables are left clean (the next batch's plan does not reset them)
    assert (eng.cell_lut == -1).all() and (eng.bucket_lut == -1).all() and (eng.rank_table == -1).all()


@pytest.mark.parametrize("pair_chunk", [None, 50])
def test_kernel_plan_is_the_causal_pairs_with_their_compact_cells(monkeypatch, pair_chunk):
    """The statistics pass's plan (pairs from the lower triangle of each window, cells compacted without sorting)
    enumerates exactly causal_pairs, in its order, and each pair's compact cell names its (query type, key bucket)
    cell; the compact cells are distinct, and their pair counts are the batch's nbar."""
    import mfpipe.stats.pass1 as pass1

    if pair_chunk is not None:
        monkeypatch.setattr(pass1, "PAIR_CHUNK", pair_chunk)  # groups of one window
    _, tracked, kb, qt = buckets(seed=3, n_windows=6, T=17)
    N, K, H, T = tracked.n, tracked.n + 2, 3, kb.shape[1]
    acc = pass1.Accumulator(1, H, 1, 1, N, T, engine="torch")
    acc.begin_batch(kb, qt)
    got_b, got_j, got_k, got_cell = [], [], [], []
    for ch in acc._plan.pairs:
        assert ch.cells.unique().numel() == ch.cells.numel()
        got_b.append(ch.gidx // (H * T * T))
        got_j.append(ch.gidx % (T * T) // T)
        got_k.append(ch.gidx % T)
        got_cell.append(ch.cells[ch.pinv])
    bb, jj, kk = next(causal_pairs(torch.as_tensor(qt), chunk=None))
    np.testing.assert_array_equal(torch.cat(got_b), bb)
    np.testing.assert_array_equal(torch.cat(got_j), jj)
    np.testing.assert_array_equal(torch.cat(got_k), kk)
    cell = torch.as_tensor(qt)[bb, jj] * K + torch.as_tensor(kb)[bb, kk]
    np.testing.assert_array_equal(torch.cat(got_cell), cell)
    np.testing.assert_array_equal(acc.sums()["nbar_sum"].reshape(-1), np.bincount(cell.numpy(), minlength=N * K))


def test_read_side_does_not_import_torch_nor_the_pass_numba():
    """The read side loads no torch; the pass loads torch, and numba (much resident memory) only once a native-engine
    reducer is built."""
    code = ("import sys\n"
            "import mfpipe.stats, mfpipe.stats.api, mfpipe.stats.store, mfpipe.stats.partials, mfpipe.stats.buckets\n"
            "from mfpipe.stats import open_stats, merge_sums, load_partial\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
            "from mfpipe.stats import accumulate_shard  # the pass itself loads torch when asked for\n"
            "assert 'torch' in sys.modules\n"
            "from mfpipe.stats import native, pass1\n"
            "pass1.Accumulator(1, 1, 4, 4, 3, 8, engine='torch')\n"
            "assert 'numba' not in sys.modules\n"
            "pass1.Accumulator(1, 1, 4, 4, 3, 8)\n"
            "assert ('numba' in sys.modules) == native.available()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
