"""Where every store a run writes lives, spelt once: relative to the results folder (config key ``results``), in the
wildcards of the rule that writes it. The rules take their store outputs and inputs from here
(:meth:`mfpipe.workflow.plan.Plan.store`), and so does the public reading API (:mod:`mfpipe.results`).

``dataset`` is ``stats`` / ``eval`` (the primary corpus), ``<cross corpus>/stats|eval`` or ``N<n>/stats`` (a top-N
arm: the primary statistics half with that tracked set); ``n`` the tracked-set size of an App. M substitution arm;
``kernel`` (``W`` / ``calibrated``) the kernel of App. B's recomputation."""

from __future__ import annotations

import re

__all__ = ["STORES", "RULES", "store_pattern"]

STORES = {
    "stats": "stats/{model}/{revision}/{dataset}.zarr",
    "deviation": "deviation/{model}/{revision}/deviation.zarr",
    "substitution": "substitution/{model}/{revision}/substitution.zarr",
    "substitution_topn": "substitution/{model}/{revision}/N{n}/substitution.zarr",
    "kernel": "kernels/{model}/{revision}/kernel.zarr",
    "calibrated": "kernels/{model}/{revision}/calibrated.zarr",
    "jlens": "jlens/{model}/{revision}/jlens.zarr",
    # App. B's recomputation with the other kernel (``kernel``: W or calibrated), beside the run's own stores
    "deviation_recompute": "recompute/{model}/{revision}/{kernel}/deviation.zarr",
    "substitution_recompute": "recompute/{model}/{revision}/{kernel}/substitution.zarr",
}
# the rule (workflow/rules/*.smk) that writes each store
RULES = {
    "stats": "stats_merge",
    "deviation": "deviation_merge",
    "substitution": "substitution",
    "substitution_topn": "substitution_topn",
    "kernel": "kernel_revision",
    "calibrated": "calibrate_kernel",
    "jlens": "jlens",
    "deviation_recompute": "deviation_merge_recompute",
    "substitution_recompute": "substitution_recompute",
}


def store_pattern(kind: str, results: str, **given) -> str:
    """Store ``kind``'s path under ``results`` with the wildcards in ``given`` filled in and the others left as
    ``{name}`` (a rule's wildcard): ``store_pattern("stats", "results", dataset="eval")`` is
    ``results/stats/{model}/{revision}/eval.zarr``."""
    unknown = set(given) - set(re.findall(r"\{(\w+)\}", STORES[kind]))
    if unknown:
        raise KeyError(f"store {kind!r} has no wildcard {sorted(unknown)}: {STORES[kind]}")
    return f"{results}/" + re.sub(r"\{(\w+)\}", lambda m: str(given.get(m.group(1), m.group(0))), STORES[kind])
