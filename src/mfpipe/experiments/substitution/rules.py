"""The training-sweep slice's planning: its targets and the input functions of workflow/rules/substitution.smk, on
the run's plan (:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations

from mfpipe.workflow.config import resolve_revisions


def topn(plan, model: str) -> list[int]:
    """App. M: the substitution of ``model`` repeated with other tracked-set sizes (the configured N is always an
    arm): the other sizes of the model's own ``top_n.n``, or else of ``substitution.top_n``, ascending."""
    c, own = plan.config, plan.models[model].get("top_n")
    sizes = own["n"] if own else c["substitution"]["top_n"]
    return sorted({int(n) for n in sizes} - {int(c["tracked"]["n_tracked"])})


def topn_revisions(plan, model: str) -> list[str]:
    """The revisions of ``model``'s sweep its top-N arms run at: its own ``top_n.revisions`` (resolved as its
    ``revisions`` are: ``final`` is the last step), or every revision of the sweep."""
    own = plan.models[model].get("top_n")
    if not own or own.get("revisions") is None:
        return list(plan.revisions[model])
    wanted = set(resolve_revisions(plan.config, dict(plan.models[model], revisions=own["revisions"])))
    return [r for r in plan.revisions[model] if r in wanted]


def substitution_results(plan, wildcards) -> list[str]:
    return [plan.store("substitution", model=wildcards.model, revision=rev) for rev in plan.revisions[wildcards.model]]


def stats_half_shards(plan, wildcards) -> list[str]:
    """The shard files of the primary corpus's statistics half (known once the corpus checkpoint has run)."""
    return plan.half_shard_files(plan.corpus, wildcards.model, "stats")


def kernel_results(plan, wildcards) -> list[str]:
    return [plan.store("kernel", model=wildcards.model, revision=rev) for rev in plan.revisions[wildcards.model]]


def topn_results(plan, wildcards) -> list[tuple]:
    """(N, revision, result) of every arm and revision of a model: the configured N first (every revision of the
    sweep, the run's own substitution), then each top-N arm at :func:`topn_revisions`."""
    m, n_tracked = wildcards.model, int(plan.config["tracked"]["n_tracked"])
    out = [(n_tracked, rev, plan.store("substitution", model=m, revision=rev)) for rev in plan.revisions[m]]
    for n in topn(plan, m):
        out += [(n, rev, plan.store("substitution_topn", model=m, revision=rev, n=n)) for rev in topn_revisions(plan, m)]
    return out


def topn_arms(plan, wildcards) -> list[list]:
    """[N, revision, step] of every result of :func:`topn_results`, in its order (the top-N table's rows)."""
    step = dict(zip(plan.revisions[wildcards.model], plan.revision_steps(wildcards.model)))
    return [[n, rev, step[rev]] for n, rev, _ in topn_results(plan, wildcards)]


def recompute_kernels(plan) -> tuple[str, str]:
    """App. B's recomputation (sec:U2M): the kernel pass 2 and the substitution rerun with (the one the run does not
    use: U, ``calibrated``, when ``substitution.kernel`` is W, else W) and the one the prompt experiments rerun with
    (U: they always run with W)."""
    return ("W" if plan.config["substitution"]["kernel"] == "calibrated" else "calibrated"), "calibrated"


def recompute_folder(plan, model: str, revision: str, kernel: str) -> str:
    """Where the recomputation's reruns with ``kernel`` write (beside, never over, the run's own outputs)."""
    return f"{plan.results}/recompute/{model}/{revision}/{kernel}"


def recompute_inputs(plan, wildcards) -> dict[str, str]:
    """The two arms of the recomputation table of a (model, revision): ``w_*`` and ``u_*`` paths of the deviation
    store, the substitution result, Exp. 1's meter summary and Exp. 2's class table, each the run's own output where
    the run used that kernel, else the rerun's."""
    m, rev, R = wildcards.model, wildcards.revision, plan.results
    rerun, prompts = recompute_kernels(plan)
    alt_prompts = recompute_folder(plan, m, rev, prompts)
    main = {"deviation": plan.store("deviation", model=m, revision=rev),
            "substitution": plan.store("substitution", model=m, revision=rev)}
    other = {k: plan.store(f"{k}_recompute", model=m, revision=rev, kernel=rerun) for k in ("deviation", "substitution")}
    w, u = (main, other) if rerun == "calibrated" else (other, main)
    out = {f"w_{k}": v for k, v in w.items()} | {f"u_{k}": v for k, v in u.items()}
    out |= {"w_meter": f"{R}/tables/icl_meter_{m}_{rev}.csv", "u_meter": f"{alt_prompts}/icl_meter.csv",
            "w_classes": f"{R}/tables/icl_classes_{m}_{rev}.csv", "u_classes": f"{alt_prompts}/icl_classes.csv"}
    return out


def targets(plan) -> list[str]:
    """Per model: every sweep revision's substitution result and the sweep table; for a real sweep (>= 2
    revisions named step<k>) the waypoint figure and the kernel dynamics; the bias table and calibration of the
    rollout revisions' kernel and the body results recomputed with it beside W (App. B)."""
    R, t = plan.results, []
    for m in plan.models:
        t += [plan.store("substitution", model=m, revision=rev) for rev in plan.revisions[m]]
        t += [f"{R}/tables/substitution_{m}.csv", f"{R}/tables/substitution_{m}.md",
              f"{R}/tables/substitution_heads_{m}.csv"]
        if plan.sweeps(m):
            t += [f"{R}/figures/waypoint_{m}.pdf", f"{R}/figures/waypoint_{m}.png"]
            t += [f"{R}/tables/kernel_cka_{m}.csv", f"{R}/tables/kernel_cka_adjacent_{m}.csv",
                  f"{R}/tables/kernel_spread_{m}.csv"]
            t += [f"{R}/figures/{f}_{m}.{e}" for f in ("kernel_cka", "kernel_spread") for e in ("pdf", "png")]
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/tables/{name}_{m}_{rev}.{e}" for name in ("kernel_bias", "calibration", "calibrated")
                  for e in ("csv", "md")]
        if topn(plan, m):
            t += [f"{R}/tables/substitution_topn_{m}.csv", f"{R}/tables/substitution_topn_{m}.md"]
            if plan.sweeps(m):
                t += [f"{R}/figures/{f}_{m}.{e}" for f in ("topn", "vocab_mfgap") for e in ("pdf", "png")]
    return t
