"""Snakemake script: mean-field substitution of one (model, revision) (Sec. 5.1): every head's read at tracked
query positions replaced by ẑ_sX from the statistics half, on held-out windows of the eval half ->
results/substitution/<model>/<revision>/substitution.zarr (L_model, L_MF, ΔL, D_MF, per-head deviation)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import math
import time
from pathlib import Path

import numpy as np

from mfpipe import __version__
from mfpipe.experiments.substitution import substitute as SU
from mfpipe.corpus.windows import list_shards, read_shard
from mfpipe.workflow.io import atomic_dir
from mfpipe.workflow.context import open_forward_job
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def eval_windows(shards_dir: Path, n_tokens: int) -> tuple[np.ndarray, list[str]]:
    """The first ceil(n_tokens / T) windows of the eval half, in shard order (fewer if the half is smaller)."""
    out, used, have = [], [], 0
    for p in list_shards(shards_dir / "eval"):
        tok = read_shard(p).tokens
        need = math.ceil((n_tokens - have) / tok.shape[1])
        out.append(tok[:need])
        used.append(p.name)
        have += out[-1].size
        if have >= n_tokens:
            break
    return np.concatenate(out), used


def main() -> None:
    p = sm.params
    job = open_forward_job(sm)
    name, revision, adapter, info = job.name, job.revision, job.adapter, job.corpus
    kernel = job.kernel(int(p.min_count))
    tokens, used = eval_windows(job.shards, int(p.eval_tokens))
    log.info("%s @ %s: substitution with %s (C >= %d) on %d eval windows x T=%d (%d tokens, shards %s)",
             name, revision, kernel.attrs["kernel"], int(p.min_count), tokens.shape[0], tokens.shape[1], tokens.size,
             ", ".join(used))
    t0 = time.perf_counter()
    sums = SU.substitution_pass(adapter, kernel, tokens, batch_size=int(p.batch_size), progress=True,
                                desc=f"substitution {name}@{revision}")
    dt = time.perf_counter() - t0
    attrs = dict(kernel.attrs)
    attrs.update({"model": name, "revision": revision, "eval_corpus_fingerprint": info["fingerprint"],
                  "eval_half_fingerprint": info.get("halves", {}).get("eval", {}).get("fingerprint"),
                  "eval_tokens": int(tokens.size), "eval_shards": ",".join(used), "mfpipe_version": __version__,
                  "stats_tokens": attrs.pop("n_tokens", None)})
    ds = SU.result_dataset(sums, attrs)
    ds.attrs["n_tokens"] = attrs.get("stats_tokens")
    with atomic_dir(Path(sm.output[0])) as tmp:
        ds.to_zarr(tmp, mode="w", zarr_format=3, consolidated=False)
    s = sums.summary()
    log.info("L_model %.4f  L_MF %.4f  ΔL %.4f  D_MF %.4f  (%.1f%% of predictions substituted) in %.1f s",
             s["L_model"], s["L_MF"], s["delta_L"], s["D_MF"], 100 * s["substituted_share"], dt)


run_logged(main, log)
