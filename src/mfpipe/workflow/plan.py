"""What the workflow plans from, in one object: the validated config's models, revisions, corpora and results
folder, and the shards a corpus checkpoint made. workflow/rules/common.smk builds one (``PLAN``); each slice's
``rules`` module (``mfpipe.<package>.rules``: its targets and the input functions of its rules) takes it, so the
rule files hold rules only and the slices' planning is importable and testable without Snakemake.

Pure standard library and config: the Snakefile reads it while it builds the DAG."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfpipe.workflow.config import corpora, resolve_revisions, resolve_rollout_revisions
from mfpipe.workflow.paths import store_pattern
from mfpipe.workflow.revisions import parse_step

__all__ = ["Plan", "HALVES"]

HALVES = ("stats", "eval")
# `mfpipe estimate` plans a run before its corpus exists: this variable holds the shard count of each half it
# predicts, {"<corpus>/<model>/<half>": n}, which then stand in for the corpus checkpoint's files
PLANNED_SHARDS_ENV = "MFPIPE_PLANNED_SHARDS"


@dataclass
class Plan:
    """The run's plan: ``config`` (validated, defaults filled in) and what follows from it."""

    config: dict
    src: Path  # the folder holding the mfpipe package (the checkout's src/)
    checkpoints: Any = None  # Snakemake's checkpoints object: the corpus shards, known once their job has run
    results: str = field(init=False)
    corpus: str = field(init=False)
    corpora: list = field(init=False)
    cross: list = field(init=False)
    models: dict = field(init=False)
    mini: dict = field(init=False)
    revisions: dict = field(init=False)
    rollout_revisions: dict = field(init=False)

    def __post_init__(self):
        c = self.config
        self.results = c["results"]  # the one key every output path derives from
        self.corpus = c["corpus"]["name"]
        self.corpora = corpora(c)  # primary first, then cross corpora (App. G)
        self.cross = [x for x in self.corpora if x != self.corpus]
        self.models = {m["name"]: m for m in c["models"]}
        self.mini = {m["name"]: m for m in (c.get("minisuite") or {}).get("models", [])}
        # `revisions`: the training sweep; the rollout-stage analyses take `rollout_revisions` (default: the last)
        self.revisions = {n: resolve_revisions(c, m) for n, m in self.models.items()}
        self.rollout_revisions = {n: resolve_rollout_revisions(c, m) for n, m in self.models.items()}

    def store(self, kind: str, **wildcards) -> str:
        """Store ``kind``'s path (:data:`mfpipe.workflow.paths.STORES`) under the results folder, ``wildcards`` filled
        in and the others left for the rule: ``plan.store("stats", dataset="stats")``."""
        return store_pattern(kind, self.results, **wildcards)

    def kernel_input(self, kernel: str):
        """The ``kernel`` input of a forward job that runs with ``kernel`` (``W`` or ``calibrated``, App. B): for U an
        input function giving the revision's calibrated store (one path, not a list: the jobs open ``input.kernel``,
        which a one-item list would make a list), for W none. Pass 2 and the substitution take the run's kernel
        (``substitution.kernel``), App. B's recomputation the other one."""
        if kernel == "calibrated":
            return lambda wc: self.store("calibrated", model=wc.model, revision=wc.revision)
        return []

    def task_data(self, file: str) -> str | None:
        """A file of the vendored task data (``mfpipe/tasks/data``: a dataset ``<task>.json``, the unrelated-word
        list) as a job input, relative to the working directory (a project moved elsewhere reruns nothing, as the
        code inputs: :func:`mfpipe.workflow.codedeps.code_inputs`); None where there is no such file."""
        import os

        path = Path(self.src) / "mfpipe" / "tasks" / "data" / file
        return os.path.relpath(path, Path.cwd()) if path.is_file() else None

    def is_mini(self, model: str) -> bool:
        return self.models[model]["source"] == "minisuite"

    def revision_steps(self, model: str) -> list:
        """Training step of each sweep revision (``step<k>``; None for a revision named otherwise, e.g. ``main``)."""
        return [parse_step(r) for r in self.revisions[model]]

    def sweeps(self, model: str) -> bool:
        """Whether the model's revisions form a training sweep: at least two, each a training step."""
        steps = self.revision_steps(model)
        return len(steps) >= 2 and all(s is not None for s in steps)

    def half_shard_ids(self, corpus: str, model: str, half: str) -> list[str]:
        """Shard numbers of one half of a model's corpus, known once the corpus checkpoint has run (or predicted by
        `mfpipe estimate`, :data:`PLANNED_SHARDS_ENV`)."""
        planned = _planned_shards()
        if planned is not None:
            return [f"{i:05d}" for i in range(int(planned[f"{corpus}/{model}/{half}"]))]
        shards = self.checkpoints.corpus_shards.get(corpus=corpus, model=model).output[0]
        return sorted(Path(p).name[len("shard-"): -len(".npz")] for p in Path(shards, half).glob("shard-*.npz"))

    def half_shard_files(self, corpus: str, model: str, half: str) -> list[str]:
        """The shard files of one half of a model's corpus (:meth:`half_shard_ids`)."""
        return self._shard_files(corpus, model, half, self.half_shard_ids(corpus, model, half))

    def _shard_files(self, corpus: str, model: str, half: str, ids: list[str]) -> list[str]:
        if _planned_shards() is not None:  # planned, not yet written: the corpus checkpoint's folder stands in
            return [f"{self.results}/corpus/{corpus}/{model}/shards"]
        return [f"{self.results}/corpus/{corpus}/{model}/shards/{half}/shard-{j}.npz" for j in ids]

    def run_of_shards(self, groups: dict, i, corpus: str, model: str, half: str, option: str) -> list[str]:
        """The corpus shard files of the job whose run of shards starts at shard ``i`` (``groups``: {first: [ids]})."""
        group = groups.get(i)
        if group is None:
            raise ValueError(f"shard {i} does not start a run of {option} shards of {corpus}/{half}")
        return self._shard_files(corpus, model, half, group)


def _planned_shards() -> dict | None:
    planned = os.environ.get(PLANNED_SHARDS_ENV)
    return json.loads(planned) if planned else None
