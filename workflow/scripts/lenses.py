"""Snakemake script: the lenses of App. P for one (model, revision) (issue 11 item 7): per head (the top-n by S̄
plus any named), the top-deviation contexts pass 2 recorded, re-run for their surrounding text, top attended keys,
next token, recomputed D and meters, and the raw logit-lens and J-lens decodes of the deviation vector (the J-lens
store of rule jlens, mfpipe.jlens) ->
results/lenses/<model>/<revision>/contexts.md|.html (context lens), decode.md (decode lens), contexts.csv."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time
from pathlib import Path

from mfpipe.deviation import shards as DP
from mfpipe.experiments.prompts import lenses as LE
from mfpipe.jlens.lens import open_jlens
from mfpipe.stats.halves import ProvenanceError, open_stats_half
from mfpipe.corpus.windows import list_shards
from mfpipe.workflow.io import atomic_write_text
from mfpipe.workflow.context import open_forward_job
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.corpus.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    name, revision = p.model_spec["name"], str(p.revision)
    tracked = TrackedSet.load(sm.input.tracked)
    shards = Path(sm.input.shards)
    st, info = open_stats_half(sm.input.stats, shards, tracked, name, revision)
    ds = DP.open_deviation(sm.input.deviation, {"model": name, "revision": revision,
                                                "tracked_fingerprint": tracked.fingerprint,
                                                "stats_fingerprint": DP.stats_fingerprint(st)})
    # the store's (top_shard, top_window) index the statistics half's sorted shard list
    shard_paths = list_shards(shards / "stats")
    half = info.get("halves", {}).get("stats", {})
    for key, have, want in (("shards", len(shard_paths), ds.attrs.get("n_partials")),
                            ("windows", half.get("n_windows"), ds.attrs.get("n_windows"))):
        if want is not None and have is not None and int(want) > int(have):
            raise ProvenanceError(f"deviation store {sm.input.deviation} was computed over {want} {key} of the "
                                  f"statistics half, {shards} has {have}: rerun the deviation stage for this corpus")
    if int(ds.attrs.get("context_length", info["context_length"])) != int(info["context_length"]):
        raise ProvenanceError(f"deviation store {sm.input.deviation} has context length {ds.attrs['context_length']}, "
                              f"the corpus {info['context_length']}: rerun the deviation stage for this corpus")
    jlens = open_jlens(sm.input.jlens, {"model": name, "revision": revision, "half": "stats",
                                        "corpus_fingerprint": info["fingerprint"]})
    job = open_forward_job(sm)  # the stores are checked above before the model loads
    adapter, tokenizer = job.adapter, job.tokenizer()
    kernel = job.kernel(ds.attrs.get("min_count")).to(adapter.device)
    t0 = time.perf_counter()
    rows = LE.mine_contexts(ds, shard_paths, heads=list(p.heads or []), per_head=int(p.per_head),
                            n_heads=int(p.n_heads), tokenizer=tokenizer)
    log.info("%s @ %s: %d contexts of %d heads (%d dropped as garbled text), kernel %s (C >= %s)", name, revision,
             len(rows), rows.groupby(["layer", "head"]).ngroups,
             int(rows.drop_duplicates(["layer", "head"])["n_garbled"].sum()), kernel.attrs["kernel"],
             kernel.attrs["min_count"])
    df = LE.context_details(adapter, kernel, tokenizer, shard_paths, rows, batch_size=int(p.batch_size), jlens=jlens)
    bad = df[~df["D_ok"]]
    if len(bad):
        log.warning("%d of %d contexts: recomputed D differs from the stored top_D by more than %g (max %.2e); they "
                    "are marked ⚠ (model dtype %s)", len(bad), len(df), LE.D_ATOL,
                    float((bad["D_recomputed"] - bad["D"]).abs().max()), p.dtype)
    atomic_write_text(sm.output.contexts_md, LE.contexts_markdown(df, name, revision))
    atomic_write_text(sm.output.contexts_html, LE.contexts_html(df, name, revision))
    atomic_write_text(sm.output.decode_md, LE.decode_markdown(df, name, revision))
    atomic_write_text(sm.output.csv, LE.contexts_csv(df))
    log.info("lenses written in %.1f s", time.perf_counter() - t0)


run_logged(main, log)
