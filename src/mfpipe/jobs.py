"""What every analysis job script does before its own work: use the job's threads, load the (model,
revision) a rule names with its adapter, and log a failure to the rule's log before re-raising."""

from __future__ import annotations

import logging
from typing import Any, Callable


def load_job_model(params: Any, threads: int | None = None):
    """(model, adapter) for a rule whose params carry ``model_spec``, ``revision``, ``dtype``, ``device``
    and ``results`` (see ``model_params()`` in workflow/rules/rollout.smk)."""
    import torch

    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.loader import load_model

    if threads:
        torch.set_num_threads(int(threads))
    model = load_model(dict(params.model_spec), params.revision, dtype=params.dtype, device=params.device,
                       results_dir=params.results)
    return model, get_adapter(model)


def run_logged(main: Callable[[], None], log: logging.Logger) -> None:
    """Run a job's ``main``; an exception goes to the rule's log with its traceback, then propagates so
    Snakemake marks the job failed and removes its outputs."""
    try:
        main()
    except BaseException:
        log.exception("failed")
        raise
