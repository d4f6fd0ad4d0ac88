"""The notebook API against the pipeline's own stores (issue 46): ``python tests/notebook_reference.py RESULTS
MODEL:REVISION ...`` loads the mini model's checkpoint as a user would (``AutoModelForCausalLM.from_pretrained``), runs
``mfpipe.collect_stats`` on the statistics half's shards, ``mfpipe.substitute`` on the substitution's held-out windows
and ``mfpipe.deviation`` on pass 2's windows, and prints a JSON report comparing each with the run's store. The
caller (tests/test_workflow.py) starts it with the workflow's pinned numerics (:func:`mfpipe.workflow.numerics.
pinned_env`) and one thread, as the ci run's jobs ran: then "equal" means bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

# attributes that say where a result came from (in memory vs. the workflow's files), not what it holds
PROVENANCE = {"model", "revision", "half", "source", "model_source", "corpus", "corpus_fingerprint", "half_fingerprint",
              "tokenizer", "tokenizer_revision", "tokenizer_commit", "revision_commit", "numerics", "mfpipe_version",
              "weights_fingerprint", "tokenizer_fingerprint"}  # the last two: what the notebook checks its inputs by


def _load(results: Path, model: str, revision: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = results / "minisuite" / model / "checkpoints" / revision
    return AutoModelForCausalLM.from_pretrained(ckpt), AutoTokenizer.from_pretrained(results / "minisuite" / "tokenizer")


def compare_stats(results: Path, model: str, revision: str, hf, tok) -> dict:
    import mfpipe
    from mfpipe.corpus.windows import list_shards, read_shard

    store = mfpipe.open_results("stats", model, revision, results)
    shards = results / "corpus" / store.attrs["corpus"] / model / "shards"
    windows = [read_shard(p).tokens for p in list_shards(shards / "stats")]
    ds = mfpipe.collect_stats(hf, windows, tokenizer=tok, n_tracked=int(store.attrs["n_tracked"]), batch_size=16,
                              partial_mantissa_bits=store.attrs.get("partial_mantissa_bits"), progress=False)
    a, b = dict(ds.attrs), dict(store.attrs)
    return {
        "variables": sorted(ds.data_vars) == sorted(store.data_vars),
        "unequal": [v for v in store.data_vars if not np.array_equal(ds[v].values, store[v].values, equal_nan=True)],
        "coords": all(np.array_equal(ds[c].values, store[c].values) for c in store.coords),
        "attrs_other": sorted(set(a) ^ set(b)),
        "attrs_differ": sorted(k for k in set(a) & set(b) - PROVENANCE if a[k] != b[k]),
        "tracked_fingerprint": a["tracked_fingerprint"] == b["tracked_fingerprint"],
        "n_windows": a["n_windows"], "source": a["source"],
    }, store, shards


def compare_substitution(results: Path, model: str, revision: str, hf, store, shards: Path) -> dict:
    import mfpipe
    from mfpipe.corpus.windows import eval_windows

    ref = mfpipe.open_results("substitution", model, revision, results)
    tokens = eval_windows(shards, n_tokens=int(ref.attrs["eval_tokens"])).tokens
    sub = mfpipe.substitute(hf, store, tokens, batch_size=16, min_count=int(ref.attrs["min_count"]))
    keys = [v for v in ref.data_vars]
    return {"unequal": [k for k in keys if not np.array_equal(sub[k].values, ref[k].values, equal_nan=True)],
            "missing": [k for k in keys if k not in sub], "delta_L": float(sub["delta_L"]), "D_MF": float(sub["D_MF"]),
            "max_abs_diff": max(float(np.nanmax(np.abs(sub[k].values - ref[k].values))) for k in keys)}


def compare_deviation(results: Path, model: str, revision: str, hf, store, shards: Path) -> dict:
    """Pass 2's store holds occurrence means per head and per query type: the per-position terms' means over the
    same windows (the statistics half's shards, as far as ``n_tokens_pass2`` reads) must give them."""
    import mfpipe
    from mfpipe.corpus.windows import list_shards, read_shard

    ref = mfpipe.open_results("deviation", model, revision, results)
    T = int(ref.attrs["context_length"])
    tokens = np.concatenate([read_shard(p).tokens for p in list_shards(shards / "stats")])
    tokens = tokens[: int(ref.attrs["n_tokens_pass2"]) // T]
    dev = mfpipe.context_deviation(hf, store, tokens, batch_size=16, reads="head", min_count=int(ref.attrs["min_count"]))
    out = {"n_contexts": [int(dev["valid"].sum()) // dev.sizes["layer"], int(ref.attrs["n_contexts"])]}
    for m in ("D", "M_cov", "M_ctx"):
        got = dev[m].mean(("window", "position"), skipna=True).values
        out[m] = float(np.max(np.abs(got - ref[m].values) / np.maximum(np.abs(ref[m].values), 1e-12)))
    qt = dev["token_id"].values  # per query type: the mean read and the mean prediction over its valid contexts
    for key, name in (("z", "zbar"), ("zhat", "zhat_bar")):
        worst = 0.0
        for s, tid in enumerate(ref["query_token_id"].values):
            want = ref[name].values[:, :, s]  # [L, H, dh]
            if (qt == tid).any() and np.isfinite(want).all():
                got = np.nanmean(dev[key].values[qt == tid].astype(np.float64), axis=0)
                worst = max(worst, float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12)))
        out[name] = worst
    return out


def main(results: str, model: str, revision: str) -> dict:
    results = Path(results)
    hf, tok = _load(results, model, revision)
    stats, store, shards = compare_stats(results, model, revision, hf, tok)
    return {"stats": stats, "substitution": compare_substitution(results, model, revision, hf, store, shards),
            "deviation": compare_deviation(results, model, revision, hf, store, shards)}


if __name__ == "__main__":
    from mfpipe.workflow.numerics import pinned

    with pinned(threads=1):
        print(json.dumps({pair: main(sys.argv[1], *pair.split(":")) for pair in sys.argv[2:]}))
