"""The function-vector slice's planning: its targets and the input functions of workflow/rules/fv.smk, on the run's
plan (:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def fv_tasks(plan, model: str) -> list[str]:
    """The function-vector tasks of ``model``: ``minisuite`` (the tasks the mini suite trained on) only for mini-suite
    models, the rest (vendored names, task files) for every model; none for a model ``fv.models`` leaves out."""
    fv = plan.config["fv"]
    if fv["models"] is not None and model not in fv["models"]:
        return []
    return [t for t in fv["tasks"] if t != "minisuite" or plan.is_mini(model)]


def fv_settings(plan, model: str) -> dict:
    """The experiment settings of ``model`` (the job's ``params.fv``): the ``fv`` block without the run-wide keys,
    its ``null`` resolved for this model (a mapping gives each model its own; models it does not name, and its
    ``default`` key where given, the mean field) and only this model's ``head_lists``, as ``{name: {task or "*":
    [heads]}}``. So naming another model's null or head list changes nothing of this model's job."""
    fv = plan.config["fv"]
    out = {k: v for k, v in fv.items() if k not in ("tasks", "models", "batch_size", "head_lists", "null")}
    null = fv.get("null", "mean_field")
    out["null"] = null if isinstance(null, str) else null.get(model, null.get("default", "mean_field"))
    lists: dict = {}
    for entry in fv.get("head_lists") or []:
        if entry["model"] != model:
            continue
        for task in entry.get("tasks") or ["*"]:
            lists.setdefault(entry["name"], {})[task] = list(entry["heads"])
    out["head_lists"] = lists
    return out


def decoded_vectors(plan, model: str):
    """The vectors the function-vector job of ``model`` decodes through the J-lens, as a function of the model's
    ``(layers, heads)`` (:func:`mfpipe.jlens.rules.decode_path` weighs them against the full J): per seed and task,
    the summed vector of each selection (AIE, MFA, each head list) and construction (raw, r), every head's ``O_h r``
    and every head's per-prompt residual of each clean prompt (App. fv-gpt2, App. fv-jlens)."""
    s = fv_settings(plan, model)
    n_tasks = sum(int(plan.config["minisuite"]["tasks"]["n_tasks"]) if t == "minisuite" else 1
                  for t in fv_tasks(plan, model))
    runs, pipes, clean = int(s["n_seeds"]) * n_tasks, 2 * (2 + len(s["head_lists"])), int(s["n_clean"])
    return lambda layers, heads: runs * (pipes + layers * heads * (1 + clean))


def task_inputs(plan, wildcards) -> list[str]:
    """The task files a job reads: the mini suite's tasks, the user's files, the vendored datasets it names and the
    unrelated-word list its unrelated population is drawn from (mfpipe.tasks): editing one reruns the job."""
    out = []
    for t in fv_tasks(plan, wildcards.model):
        vendored = plan.task_data(f"{t}.json")
        if t == "minisuite":
            out.append(f"{plan.results}/minisuite/tasks.json")
        elif t.endswith(".json"):
            out.append(t)
        elif vendored:
            out.append(vendored)
    words = plan.task_data("unrelated-words.txt")
    return out + [words] if out and words else out


def targets(plan) -> list[str]:
    """Per rollout revision of every model with tasks: the tables and the figure."""
    R, t = plan.results, []
    for m in plan.models:
        if not fv_tasks(plan, m):
            continue
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/tables/fv_{m}_{rev}.{e}" for e in ("csv", "md")]
            t += [f"{R}/tables/fv_per_head_{m}_{rev}.md", f"{R}/tables/fv_details_{m}_{rev}.md"]
            t += [f"{R}/tables/fv_clean_{m}_{rev}.{e}" for e in ("csv", "md")]
            t += [f"{R}/figures/fv{kind}_{m}_{rev}.{e}" for kind in ("", "_clean") for e in ("pdf", "png")]
    return t
