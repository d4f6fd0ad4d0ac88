"""Pass 2's planning: its targets (the deviation stores) and the input functions of workflow/rules/deviation.smk, on
the run's plan (:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations

from mfpipe.corpus.windows import shard_groups


def deviation_shard_ids(plan, wildcards) -> list[str]:
    """The statistics half's shards pass 2 reads (ids), from the first, until `deviation.tokens` (null: all)."""
    ids = plan.half_shard_ids(plan.corpus, wildcards.model, "stats")
    limit = plan.config["deviation"]["tokens"]
    if limit is not None:
        corpus = plan.config["corpus"]
        per_shard = int(corpus["shard_windows"]) * int(corpus["context_length"])
        ids = ids[: max(1, -(-int(limit) // per_shard))]
    return ids


def deviation_groups(plan, wildcards) -> dict:
    """Those shards as the pass-2 jobs take them ({first shard: [shards]}, `deviation.shards_per_job`)."""
    return shard_groups(deviation_shard_ids(plan, wildcards), plan.config["deviation"]["shards_per_job"])


def deviation_partials(plan, wildcards, folder: str | None = None) -> list[str]:
    """The pass-2 jobs' outputs of a (model, revision): a folder per run of shards, one partial per shard inside, under
    ``folder``/partials (default: the deviation store's folder; another for a rerun of pass 2 with another kernel)."""
    folder = folder or f"{plan.results}/deviation/{wildcards.model}/{wildcards.revision}"
    return [f"{folder}/partials/group-{i}" for i in deviation_groups(plan, wildcards)]


def deviation_group_shards(plan, wildcards) -> list[str]:
    """The corpus shards of one pass-2 job (the run of shards starting at shard `i`)."""
    return plan.run_of_shards(deviation_groups(plan, wildcards), wildcards.i, plan.corpus, wildcards.model, "stats",
                              "deviation.shards_per_job")


def targets(plan) -> list[str]:
    """Per model: every sweep revision's deviation store."""
    return [plan.store("deviation", model=m, revision=rev) for m in plan.models for rev in plan.revisions[m]]
