"""The explorer's jobs (workflow/rules/explorer.smk; run by :func:`mfpipe.workflow.runner.run_job`). Each imports what it
runs inside its body, so its code inputs are its own."""

from __future__ import annotations

__all__ = ["explorer_assets", "explorer", "explorer_index"]


def explorer_assets(job) -> None:
    """plotly.js and the explorer's script and style -> results/explorer/assets/ (shared by every model's pages)."""
    from mfpipe.explorer.assets import ASSETS, write_assets
    from mfpipe.workflow.io import atomic_dir

    with atomic_dir(job.output.folder) as tmp:
        write_assets(tmp)
    job.log.info("explorer assets written: %s", ", ".join(ASSETS))


def explorer(job) -> None:
    """One model's explorer -> results/explorer/<model>/index.html and data/ (the model's scores and pages, one card
    per head and revision, the linked tables), from the run's tables and stores (params.files: which is which)."""
    import json
    import time

    from tqdm import tqdm

    from mfpipe.explorer.site import build_model, model_page
    from mfpipe.workflow.io import atomic_dir, atomic_write_text

    p, out, log = job.params, job.output, job.log
    files = {k: (dict(v) if isinstance(v, dict) else v) for k, v in dict(p.files).items()}
    revisions, steps = list(p.revisions), list(p.steps)
    t0 = time.perf_counter()
    with atomic_dir(out.data) as tmp, tqdm(total=len(revisions), desc=f"explorer {p.model}", unit="revision") as bar:
        summary = build_model(tmp, files, model=p.model, revisions=revisions, steps=steps,
                              rollout_revisions=list(p.rollout_revisions), induction_window=p.induction_window,
                              top_types=int(p.top_types), progress=lambda rev: bar.update(1))
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out.index, model_page(p.model))  # last: it marks the model's explorer done
    log.info("%s: %d cards (%d layers x %d heads x %d revisions) in %.1f s", p.model, summary["cards"],
             summary["n_layers"], summary["n_heads"], summary["revisions"], time.perf_counter() - t0)


def explorer_index(job) -> None:
    """The index over the models -> results/explorer/index.html (each model's summary from its data folder)."""
    import json
    from pathlib import Path

    from mfpipe.explorer.site import index_page
    from mfpipe.workflow.io import atomic_write_text

    summaries = [json.loads((Path(p).parent / "data" / "summary.json").read_text()) for p in job.input.pages]
    atomic_write_text(job.output.index, index_page(summaries))
    job.log.info("explorer index: %d models", len(summaries))
