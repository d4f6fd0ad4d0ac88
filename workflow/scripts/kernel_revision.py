"""Snakemake script: one checkpoint's kernel summary for the kernel dynamics (Sec. 5.3, App. N) -- the column-centred
rank-r factors of W = P / nbar on the C >= min_count support and the row spread per head -- from its statistics
store, as a labelled zarr store (written atomically) carrying the store's provenance.

input.stats      the revision's statistics-half store (stats.zarr)
output[0]        kernel.zarr (directory): factor (layer, head, query, rank), spread (layer, head), rank_energy,
                 support_size; attrs: the store's provenance + min_count, rank, support_fingerprint
params.model, params.revision (checked against the store), params.min_count (20), params.rank (96)
"""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow.runner import run_logged
from mfpipe.experiments.substitution.kernel_dynamics import kernel_dataset
from mfpipe.workflow.logs import setup_logging
from mfpipe.stats import open_stats
from mfpipe.stats.store import write_store

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0] if sm.log else None)


def main() -> None:
    import torch  # the factors' Gram products and eigendecompositions: on the job's threads, not torch's default

    torch.set_num_threads(int(sm.threads))
    model, revision = str(sm.params.model), str(sm.params.revision)
    stats = open_stats(sm.input.stats, expect={"model": model, "revision": revision})
    ds = kernel_dataset(stats, min_count=int(sm.params.min_count), rank=int(sm.params.rank))
    write_store(ds, sm.output[0])
    log.info("%s @ %s: kernel factors (L=%d, H=%d, N=%d, rank %d) on %d supported pairs; mean row spread %.3f, "
             "rank-%d energy >= %.4f; wrote %s", model, revision, ds.sizes["layer"], ds.sizes["head"],
             ds.sizes["query"], ds.attrs["rank"], ds.attrs["support_size"], float(ds["spread"].mean()),
             ds.attrs["rank"], float(ds["rank_energy"].min()), sm.output[0])


run_logged(main, log)
