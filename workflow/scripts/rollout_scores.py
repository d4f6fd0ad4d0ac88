"""Snakemake script: Alg. 1 with every configured kernel for one (model, revision), scored per depth against
the held-out centroids -> results/rollout/<model>/<revision>/scores.csv (long table)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time

from mfpipe.workflow import tables as T
from mfpipe.experiments.rollout import tables as RT
from mfpipe.experiments.rollout import runs as RO
from mfpipe.workflow.runner import load_job_model, run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    model, adapter = load_job_model(p, sm.threads)
    t0 = time.perf_counter()
    df = RO.run_rollouts(model, adapter, sm.input.stats, sm.input.eval, kernels=list(p.kernels), seed=int(p.seed),
                        pin=bool(p.pin_rogue), rogue_factor=float(p.rogue_factor), init=str(p.init),
                        min_count=int(p.min_count), model_name=p.model_spec["name"], revision=p.revision)
    log.info("%d kernels%s in %.1f s", len(p.kernels), " (+ pinned)" if p.pin_rogue else "", time.perf_counter() - t0)
    T.write_csv(df, sm.output[0])
    log.info("\n%s", RT.summary_markdown(RT.rollout_summary(df)))


run_logged(main, log)
