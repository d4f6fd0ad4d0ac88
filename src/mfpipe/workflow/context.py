"""What a forward-pass job starts from, in one place: the tracked set, the statistics half of the job's (model,
revision) checked against that tracked set and the corpus, the calibrated kernel U when the rule asks for it, the
model loaded and checked against the store, and on request the mean-field kernel.

The order is deliberate: every store is opened and provenance-checked before the model loads, so a stale or
foreign store is refused in a second rather than after the weights are read. A job that checks further stores
against the statistics half (the lenses: the deviation store and the J-lens) opens the job with ``load=False``,
checks them against ``job.stats`` / ``job.corpus``, then calls :meth:`ForwardJob.load_model`: the half is opened once.

A job function calls :func:`open_forward_job` with its :class:`~mfpipe.workflow.runner.Job` (or a Snakemake object);
the rule provides ``input.tracked``, ``input.stats``, ``input.shards`` (or passes ``shards_dir``), ``input.kernel``
where ``params.kernel`` is ``calibrated``, and the model params of ``model_params()`` (workflow/rules/common.smk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfpipe.corpus.tracked import TrackedSet
from mfpipe.stats.api import MeanFieldStats
from mfpipe.stats.halves import check_model, open_stats_half
from mfpipe.workflow.runner import stream_setting

__all__ = ["ForwardJob", "open_forward_job"]


@dataclass
class ForwardJob:
    """The (model, revision) of one forward-pass job with everything checked against each other."""

    name: str
    revision: str
    params: Any
    tracked: TrackedSet
    shards: Path
    stats: MeanFieldStats
    corpus: dict  # the corpus's info (mfpipe.stats.halves.corpus_info)
    calibrated: Any = None  # xarray U (App. B) when params.kernel == "calibrated"
    threads: int | None = None
    stream: bool | str = False  # runtime.stream_weights (mfpipe.workflow.runner.stream_setting)
    _model: Any = field(default=None, repr=False)
    _adapter: Any = field(default=None, repr=False)
    _kernels: dict = field(default_factory=dict, repr=False)

    def load_model(self) -> ForwardJob:
        """Load the (model, revision) with its adapter and check it against the statistics store (once)."""
        from mfpipe.workflow.runner import load_job_model

        if self._adapter is None:
            self._model, self._adapter = load_job_model(self.params, self.threads, stream=self.stream)
            check_model(self._adapter, self.stats)
        return self

    @property
    def model(self):
        return self.load_model()._model

    @property
    def adapter(self):
        return self.load_model()._adapter

    def kernel(self, min_count: int | None = None):
        """The :class:`~mfpipe.meanfield.kernel.MeanFieldKernel` of the statistics half (U when the rule asked for
        the calibrated kernel), on the host; ``min_count`` None takes the store's default support."""
        from mfpipe.meanfield.kernel import kernel_from_store

        key = None if min_count is None else int(min_count)
        if key not in self._kernels:
            self._kernels[key] = kernel_from_store(self.stats, self.tracked, min_count=key,
                                                   calibrated=self.calibrated)
        return self._kernels[key]

    def tokenizer(self):
        """The tokenizer the corpus was tokenized with (the model's ``tokenizer_revision``, not the job's revision:
        prompts and corpus must agree; the mini suite's from the results folder)."""
        from mfpipe.models.loader import load_tokenizer

        return load_tokenizer(dict(self.params.model_spec), results_dir=self.params.results)


def open_forward_job(job, *, shards_dir: str | Path | None = None, threads: int | None = None,
                     load: bool = True) -> ForwardJob:
    """Open the forward-pass job ``job`` (a :class:`~mfpipe.workflow.runner.Job` or a Snakemake object: see the module
    docstring for what its rule provides): its stores, checked, then (``load``) its model."""
    p, inp = job.params, job.input
    name, revision = p.model_spec["name"], str(p.revision)
    tracked = TrackedSet.load(inp.tracked)
    shards = Path(shards_dir if shards_dir is not None else inp.shards)
    stats, corpus = open_stats_half(inp.stats, shards, tracked, name, revision)
    calibrated = None
    if str(getattr(p, "kernel", "W")) == "calibrated":
        from mfpipe.meanfield.calibrated import load_calibrated

        calibrated = load_calibrated(inp.kernel, expect={"model": name, "revision": revision,
                                                         "tracked_fingerprint": tracked.fingerprint})
    fj = ForwardJob(name, revision, p, tracked, shards, stats, corpus, calibrated,
                    threads=int(job.threads) if threads is None else threads,
                    stream=stream_setting(getattr(job, "config", None)))
    return fj.load_model() if load else fj
