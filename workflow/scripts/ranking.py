"""Snakemake script: the head ranking of one (model, revision) (Sec. 6.3, App. P): every head by S̄ with M_cov, M_ctx
and the behavioural scores, Tables ranking-cc (top) and bottom, split-half stability, Fig. ccmf-scatter."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import pandas as pd

from mfpipe.workflow import tables as T
from mfpipe.deviation.store import open_deviation
from mfpipe.experiments.ranking.heads import heads_table, split_half_stability, top_bottom
from mfpipe.experiments.ranking.figures import ccmf_scatter, head_roles
from mfpipe.experiments.ranking.head_scores import open_head_scores
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    dev = open_deviation(sm.input.deviation, {"model": p.model, "revision": str(p.revision)})
    scores = open_head_scores(sm.input.heads)
    if scores.attrs.get("revision") not in (None, str(p.revision)):
        raise ValueError(f"{sm.input.heads} holds revision {scores.attrs['revision']}, expected {p.revision}")
    table = heads_table(dev, scores)
    table.insert(4, "role", head_roles(table))
    top, bottom = top_bottom(table, int(p.top), int(p.bottom))
    stability = pd.DataFrame([split_half_stability(table, int(p.top))])
    T.write_table(table, csv=sm.output.heads)
    T.write_table(top, csv=sm.output.top_csv, md=sm.output.top_md)
    T.write_table(bottom, csv=sm.output.bottom_csv, md=sm.output.bottom_md)
    T.write_table(stability, csv=sm.output.stability_csv, md=sm.output.stability_md)
    ccmf_scatter(table, sm.output.png, top=int(p.top), title=f"{p.model} @ {p.revision}: heads on the M_cov / M_ctx plane")
    log.info("top heads:\n%s\nbottom heads:\n%s\nsplit-half: %s",
             T.to_markdown(top.head(10), floatfmt="{:.3f}"), T.to_markdown(bottom.head(10), floatfmt="{:.3f}"),
             stability.iloc[0].to_dict())


run_logged(main, log)
