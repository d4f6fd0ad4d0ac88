"""The statistics stage's planning: its targets and the input functions of workflow/rules/stats.smk, on the run's
plan (:class:`mfpipe.workflow.plan.Plan`). A dataset is a half of the primary corpus (``stats``, ``eval``), of a
cross corpus (``<corpus>/<half>``), ``N<n>/stats``: the primary corpus's statistics half with a top-N arm's tracked
set (App. M), or ``excl/<half>``: a primary half with the exclusion arm's tracked set (config ``exclusion``)."""

from __future__ import annotations

from mfpipe.corpus.windows import shard_groups
from mfpipe.workflow.plan import HALVES


# the dataset prefix of the exclusion arm (`excl/stats`, `excl/eval`: tracked-excl.json; config section `exclusion`)
EXCLUSION_ARM = "excl"


def topn_arm(prefix: str) -> bool:
    """Whether a dataset prefix names a top-N arm (`N2000`: the primary corpus with another tracked set)."""
    return prefix[:1] == "N" and prefix[1:].isdigit()


def tracked_arm(prefix: str) -> bool:
    """Whether a dataset prefix names an arm of the primary corpus with its own tracked set, tracked-<prefix>.json:
    a top-N arm or the exclusion arm."""
    return topn_arm(prefix) or prefix == EXCLUSION_ARM


def dataset_parts(plan, dataset: str) -> tuple[str, str]:
    """(corpus, half) of a stats dataset: `stats` / `eval` of the primary corpus, `<corpus>/<half>` of a cross
    corpus, `N<n>/stats`: the primary corpus's statistics half with the top-n tracked set (App. M), or `excl/<half>`:
    a primary half with the exclusion arm's tracked set."""
    corpus, _, half = dataset.rpartition("/")
    return (plan.corpus if not corpus or tracked_arm(corpus) else corpus), half


def datasets(plan, corpus: str | None = None) -> list[str]:
    """The datasets of a corpus's halves (the primary corpus's: `stats`, `eval`)."""
    prefix = "" if corpus in (None, plan.corpus) else f"{corpus}/"
    return [prefix + h for h in HALVES]


def shard_ids(plan, wildcards) -> list[str]:
    """Shard numbers of a dataset, known once the corpus checkpoint has run."""
    corpus, half = dataset_parts(plan, wildcards.dataset)
    return plan.half_shard_ids(corpus, wildcards.model, half)


def stats_groups(plan, wildcards) -> dict[str, list[str]]:
    """The dataset's shards as its statistics jobs take them ({first shard: [shards]}, `stats.shards_per_job`)."""
    return shard_groups(shard_ids(plan, wildcards), plan.config["stats"]["shards_per_job"])


def stats_partials(plan, wildcards) -> list[str]:
    """The statistics jobs' outputs of a dataset: a folder per run of shards, one partial per shard inside."""
    return [
        f"{plan.results}/stats/{wildcards.model}/{wildcards.revision}/partials/{wildcards.dataset}/group-{i}"
        for i in stats_groups(plan, wildcards)
    ]


def dataset_group_shards(plan, wildcards) -> list[str]:
    """The corpus shards of one statistics job (the run of shards starting at shard `i`)."""
    corpus, half = dataset_parts(plan, wildcards.dataset)
    return plan.run_of_shards(stats_groups(plan, wildcards), wildcards.i, corpus, wildcards.model, half,
                              "stats.shards_per_job")


def dataset_shards_dir(plan, wildcards) -> str:
    """The corpus shards folder of a dataset."""
    return f"{plan.results}/corpus/{dataset_parts(plan, wildcards.dataset)[0]}/{wildcards.model}/shards"


def targets(plan) -> list[str]:
    """Per model and rollout revision: the statistics store of every half of every corpus (primary and cross)."""
    R, t = plan.results, []
    for m in plan.models:
        for rev in plan.rollout_revisions[m]:
            t += [plan.store("stats", model=m, revision=rev, dataset=ds) for c in plan.corpora for ds in datasets(plan, c)]
    return t
