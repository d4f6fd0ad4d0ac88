"""Snakemake script: the additive statistics sums of one corpus shard (one traced forward per batch, all
layers at once) -> one partial (a compressed Zarr folder, mfpipe.stats.partials), written atomically."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time

from mfpipe.corpus.windows import read_shard
from mfpipe.jobs import load_job_model, run_logged
from mfpipe.logs import setup_logging
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
    tokens = read_shard(sm.input.shard).tokens
    model, adapter = load_job_model(sm.params, sm.threads)
    log.info("%s @ %s (%r, %s on %s): shard %s, %d windows x T=%d, N=%d tracked, batch %d",
             spec["name"], revision, adapter, dtype, adapter.device, sm.input.shard, tokens.shape[0], tokens.shape[1],
             tracked.n, int(sm.params.batch_size))
    t0 = time.perf_counter()
    sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=int(sm.params.batch_size), progress=True)
    dt = time.perf_counter() - t0
    meta = partial_meta(tracked, tokens, {
        "model": spec["name"], "revision": revision, "dtype": dtype, "model_type": adapter.model_type,
        "n_layers": adapter.n_layers, "n_heads": adapter.n_heads, "n_kv_heads": adapter.n_kv_heads,
        "d_model": adapter.d_model, "d_head": adapter.d_head, "parallel_residual": adapter.parallel_residual,
        "shard": str(sm.input.shard),
    } | ({"revision_commit": str(sm.params.commit)} if sm.params.commit else {}))
    bits = sm.params.mantissa_bits
    save_partial(sm.output[0], sums, meta, mantissa_bits=None if bits is None else int(bits))
    log.info("%d tokens in %.1f s (%.0f tok/s); %d tracked queries; partial %s (%.0f MiB on disk)",
             tokens.size, dt, tokens.size / max(dt, 1e-9), int(sums["query_count"].sum()), sm.output[0],
             partial_size(sm.output[0]) / 2**20)


run_logged(main, log)
