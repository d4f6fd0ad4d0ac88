"""Snakemake script: the training sweep of one model (Sec. 5.2): one row per revision of L_model, L_MF, ΔL, D_MF
and coverage (CSV + Markdown), and the per-head deviation at every checkpoint (long CSV)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)

from mfpipe.workflow import tables as T
from mfpipe.experiments.substitution import substitute as SU
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    if hasattr(p, "arms"):  # App. M: one block of rows per tracked-set size
        df = SU.topn_table(list(sm.input.results), [tuple(a) for a in p.arms], str(p.model))
        T.write_csv(df, sm.output.csv)
        T.write_text(T.to_markdown(df, floatfmt="{:.4f}"), sm.output.md)
        log.info("\n%s", T.to_markdown(df[["n_tracked", "revision", "delta_L", "D_MF", "substituted_share"]],
                                       floatfmt="{:.4f}"))
        return
    revisions, steps = list(p.revisions), [None if s is None else int(s) for s in p.steps]
    df = SU.sweep_table(list(sm.input.results), revisions, steps, str(p.model))
    T.write_csv(df, sm.output.csv)
    T.write_text(T.to_markdown(df, floatfmt="{:.4f}"), sm.output.md)
    heads = SU.head_deviation_table(list(sm.input.results), revisions, steps, str(p.model))
    T.write_csv(heads, sm.output.heads)
    log.info("\n%s", T.to_markdown(df[["revision", "step", "L_model", "L_MF", "delta_L", "D_MF", "substituted_share"]],
                                   floatfmt="{:.4f}"))


run_logged(main, log)
