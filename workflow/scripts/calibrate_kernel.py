"""Snakemake script: the bias of the context-conditional kernel Â and the calibrated kernel U of one (model,
revision) (App. B: Table tab:ahat-empirical-bias, Alg. sinkhorn, Table tab:calib2M), from its statistics store and
the shards of the half the store was measured on. U is written as a labelled zarr store (atomically) carrying
the statistics store's provenance, so `mfpipe.meanfield.calibrated.load_calibrated(path, expect=...)` can check it.

input.stats      the revision's statistics-half store; input.shards: that half's shard .npz files;
                 input.tracked: tracked.json (must be the store's tracked set)
output.kernel    calibrated.zarr (directory): U (layer, head, query, key) float32, the store's coords and provenance
output.bias, output.bias_md          Table tab:ahat-empirical-bias per layer and "all" (CSV, Markdown)
output.residuals, output.residuals_md  Table tab:calib2M per layer and iteration (CSV, Markdown)
params.model, params.revision, params.min_count (20), params.iterations (5), params.alpha (1.0), params.batch_size;
optional params.device ("cpu", "cuda", "auto"; default cpu) and params.dtype (of the passes; default float64)
"""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time

import torch

from mfpipe.meanfield.calibrated import calibrated_dataset, write_calibrated
from mfpipe.experiments.substitution.calibration import calibrate_stats, residual_markdown
from mfpipe.corpus.windows import read_shard
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.stats import open_stats
from mfpipe.workflow.tables import to_markdown, write_csv, write_text
from mfpipe.corpus.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0] if sm.log else None)


def main() -> None:
    model, revision = str(sm.params.model), str(sm.params.revision)
    if getattr(sm, "threads", None):
        torch.set_num_threads(int(sm.threads))
    device = str(getattr(sm.params, "device", "cpu") or "cpu")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, str(getattr(sm.params, "dtype", None) or "float64"))  # of the passes; U is float64
    tracked = TrackedSet.load(sm.input.tracked)
    stats = open_stats(sm.input.stats, expect={"model": model, "revision": revision,
                                              "tracked_fingerprint": tracked.fingerprint})
    shards = sorted(str(p) for p in sm.input.shards)
    tokens = [read_shard(p).tokens for p in shards]
    min_count, iterations = int(sm.params.min_count), int(sm.params.iterations)
    alpha, batch = float(sm.params.alpha), int(sm.params.batch_size)
    log.info("%s @ %s: calibrating W (min_count %d) over %d shards (%d windows), %d iterations, alpha %g, batch %d, "
             "%s, passes in %s", model, revision, min_count, len(shards), sum(t.shape[0] for t in tokens), iterations,
             alpha, batch, device, dtype)
    t0 = time.perf_counter()
    U, bias, res = calibrate_stats(stats, tokens, tracked, min_count=min_count, iterations=iterations, alpha=alpha,
                                   batch_size=batch, device=device, progress=True, log=log, dtype=dtype)
    bias.insert(0, "revision", revision)
    bias.insert(0, "model", model)
    res.insert(0, "revision", revision)
    res.insert(0, "model", model)
    ds = calibrated_dataset(U, stats, {"min_count": min_count, "calibration_iterations": iterations,
                                       "calibration_dtype": str(dtype).replace("torch.", ""),
                                       "calibration_alpha": alpha, "calibration_shards": len(shards)})
    write_calibrated(ds, sm.output.kernel)
    write_csv(bias, sm.output.bias)
    write_text(f"### Bias of Â: {model} @ {revision}\n\n" + to_markdown(bias), sm.output.bias_md)
    write_csv(res, sm.output.residuals)
    write_text(residual_markdown(res, title=f"Calibration residuals: {model} @ {revision}"), sm.output.residuals_md)
    allrow = bias[bias["layer"] == "all"].iloc[0]
    log.info("%s @ %s: E_s[N_X] %.3f, E_st[n_t] %.3f, ratio %.3f, %.1f%% of %d cells within 20%%, <bos> %.3f; "
             "wrote %s in %.0f s", model, revision, allrow["E_NX"], allrow["E_nt"], allrow["ratio"],
             100 * allrow["within_20pct"], allrow["n_cells"], allrow["bos_ratio"], sm.output.kernel,
             time.perf_counter() - t0)


run_logged(main, log)
