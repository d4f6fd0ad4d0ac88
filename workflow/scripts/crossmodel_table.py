"""Snakemake script: the cross-model comparison table (one row per model: rollout accuracy, ΔL and D_MF at the
last revision and at their peak, the top heads by S̄ with their roles, the function-vector transfer where the model
has it)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)

from mfpipe.workflow import tables as T
from mfpipe.experiments.crossmodel import compare as C
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    fv = dict(zip(p.fv_models, sm.input.fv))
    rows = [C.comparison_row(m, substitution=s, rollout=r, ranking=h, tokens_per_step=p.tokens_per_step[m],
                             fv=fv.get(m))
            for m, s, r, h in zip(p.models, sm.input.substitution, sm.input.rollout, sm.input.ranking)]
    df = C.comparison_table(rows)
    T.write_csv(df, sm.output.csv)
    T.write_text(T.to_markdown(df, floatfmt="{:.4f}"), sm.output.md)
    log.info("\n%s", T.to_markdown(df, floatfmt="{:.4f}"))


run_logged(main, log)
