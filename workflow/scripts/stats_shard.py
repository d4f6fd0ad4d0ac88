"""Snakemake script: the additive statistics sums of a run of corpus shards (one traced forward per batch, all
layers at once), one partial per shard (a compressed Zarr folder, mfpipe.stats.partials) in the job's output folder,
published atomically once every shard's partial is written. The model loads once for the run."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time
from pathlib import Path

from mfpipe.corpus.windows import read_shard
from mfpipe.workflow.io import atomic_dir
from mfpipe.workflow.runner import load_job_model, run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.stats.partials import partial_meta, partial_size, save_partial
from mfpipe.stats.shards import accumulate_shard
from mfpipe.corpus.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    spec = dict(sm.params.model_spec)
    revision = str(sm.params.revision)
    dtype = str(sm.params.dtype)
    tracked = TrackedSet.load(sm.input.tracked)
    shards = [str(s) for s in sm.input.shards]
    model, adapter = load_job_model(sm.params, sm.threads)
    log.info("%s @ %s (%r, %s on %s): %d shard(s) from %s, N=%d tracked, batch %d", spec["name"], revision, adapter,
             dtype, adapter.device, len(shards), shards[0], tracked.n, int(sm.params.batch_size))
    bits = sm.params.mantissa_bits
    with atomic_dir(sm.output[0]) as out:
        for shard in shards:
            tokens = read_shard(shard).tokens
            t0 = time.perf_counter()
            sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=int(sm.params.batch_size),
                                    progress=True, desc=f"stats {Path(shard).stem}")
            dt = time.perf_counter() - t0
            meta = partial_meta(tracked, tokens, {
                "model": spec["name"], "revision": revision, "dtype": dtype, "model_type": adapter.model_type,
                "n_layers": adapter.n_layers, "n_heads": adapter.n_heads, "n_kv_heads": adapter.n_kv_heads,
                "d_model": adapter.d_model, "d_head": adapter.d_head, "parallel_residual": adapter.parallel_residual,
                "shard": shard,
            } | ({"revision_commit": str(sm.params.commit)} if sm.params.commit else {}))
            part = out / (Path(shard).stem + ".zarr")  # partial shard-NNNNN.zarr <- corpus shard-NNNNN.npz
            save_partial(part, sums, meta, mantissa_bits=None if bits is None else int(bits))
            log.info("%s: %d windows x T=%d, %d tokens in %.1f s (%.0f tok/s); %d tracked queries; partial %.0f MiB "
                     "on disk", shard, tokens.shape[0], tokens.shape[1], tokens.size, dt, tokens.size / max(dt, 1e-9),
                     int(sums["query_count"].sum()), partial_size(part) / 2**20)
    log.info("%d partial(s) in %s", len(shards), sm.output[0])


run_logged(main, log)
