"""Snakemake script: App. F attention-mass coverage (tracked / position 0 / other, tracked share of non-sink
attention) from each model's statistics-half kernel P."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow import tables as T
from mfpipe.experiments.rollout import accounting as AC
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.workflow.tables import to_markdown

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    df = AC.attention_coverage(list(sm.input.stats), expect={"half": "stats"})
    T.write_csv(df, sm.output.csv)
    md = "**Attention-mass coverage (App. F): mean over layers, heads and tracked query types**\n\n" + to_markdown(df)
    T.write_text(md, sm.output.md)
    log.info("\n%s", md)


run_logged(main, log)
