"""Snakemake script: the error accounting of Sec. 4.3 and App. D, H, K for one (model, revision):
teacher-forced attention, the nested estimators (a)(b)(c), the MLP gap, within-type clustering with the
value-map Jensen gap, and anisotropy -> one CSV (+ Markdown) each under results/tables/."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow import tables as T
from mfpipe.experiments.rollout import tables as RT
from mfpipe.experiments.rollout import accounting as AC
from mfpipe.experiments.rollout import runs as RO
from mfpipe.stats import halves as S
from mfpipe.deviation.store import open_deviation
from mfpipe.workflow.runner import load_job_model, run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    tag = f"{p.model_spec['name']} @ {p.revision}"
    model, adapter = load_job_model(p, sm.threads)
    st, ev = S.open_pair(sm.input.stats, sm.input.eval, model=p.model_spec["name"], revision=p.revision)
    setup = RO.prepare(adapter, st, ev, min_count=int(p.min_count))
    diag = ev if p.diagnostics_half == "eval" else st

    tf = AC.teacher_forced_table(adapter, setup)
    T.write_csv(tf, sm.output.teacher_forced)
    T.write_text(RT.wide_markdown(RT.long_to_wide(tf, "layer"), "layer", ["frac_depth", "cosine", "rsa", "rel_error",
                 "norm_ratio"], title=f"Teacher-forced attention (sum_h zhat vs measured sum_h zbar): {tag}"),
                 sm.output.teacher_forced_md)

    ed = AC.error_decomposition_table(adapter, setup, open_deviation(sm.input.deviation, {
        "model": p.model_spec["name"], "revision": str(p.revision)}))
    T.write_csv(ed, sm.output.error_decomposition)
    T.write_text(RT.error_decomposition_markdown(ed, tag), sm.output.error_decomposition_md)

    mg = AC.mlp_gap_table(adapter, diag, min_count=int(p.min_count))
    T.write_csv(mg, sm.output.mlp_gap)
    T.write_text(RT.wide_markdown(mg, "layer", ["cosine", "rel_error", "rsa", "norm_ratio"],
                                 title=f"MLP gap (MLP at the mean input vs occurrence-mean MLP), {p.diagnostics_half} "
                                       f"half: {tag}"), sm.output.mlp_gap_md)

    cl = AC.clustering_table(adapter, diag, min_count=int(p.min_count))
    T.write_csv(cl, sm.output.clustering)
    T.write_text(RT.wide_markdown(cl, "depth", ["rel_rms_median", "eta2", "eta2_z", "jensen_rel_median",
                                               "jensen_dir_median"], digits=4,
                                 title=f"Within-type clustering and value-map Jensen gap, {p.diagnostics_half} half: "
                                       f"{tag}"), sm.output.clustering_md)

    an = AC.anisotropy_table(diag, min_count=int(p.min_count))
    T.write_csv(an, sm.output.anisotropy)
    T.write_text(RT.wide_markdown(an, "depth", ["norm_mean", "mean_dist", "ratio"],
                                 title=f"Anisotropy of the type-centroid cloud, {p.diagnostics_half} half: {tag}"),
                 sm.output.anisotropy_md)
    log.info("teacher-forced:\n%s", RT.long_to_wide(tf, "layer").to_string())
    log.info("error decomposition:\n%s", RT.long_to_wide(ed, "layer", by="estimator").to_string())


run_logged(main, log)
